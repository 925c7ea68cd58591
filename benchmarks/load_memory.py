"""Peak host memory of a worker's process while it loads a target, by how the hf engine places the weights.

    python benchmarks/load_memory.py [--target PATH] [--device cpu|cuda:0] [--tensor-parallel N]

Each way runs in a fresh process, which samples its own /proc/self/status (and its followers') every 5 ms while it
loads, and reports the peak of anonymous memory (RssAnon: what the process itself holds, not the checkpoint's pages
in the page cache, which the kernel can drop) and the peak resident set (VmHWM, the page cache's mapped pages
included), against the checkpoint's size on disk:

- ``to-device``: ``from_pretrained(target, dtype)`` then ``.to(device)`` (the hf engine before it placed weights);
- ``device-map``: the hf engine today, ``device_map={"": device}``: weights go straight to the device;
- ``tensor-parallel``: ``--tensor-parallel N``: each of the N processes loads its shard (only on CPU it holds it in host
  memory), reported for the worker's own process and the largest follower.

Without ``--target`` it builds a random-weight Llama of about 1 GB (float32) in a temporary folder.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

FIELDS = ("RssAnon", "VmHWM")


def status_kib(pid: int | str = "self") -> dict[str, int]:
    values = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, rest = line.partition(":")
            if key in FIELDS:
                values[key] = int(rest.split()[0])
    except FileNotFoundError:
        pass
    return values


class PeakSampler(threading.Thread):
    """The largest value of each field seen in ``pids()``'s processes until ``stop()``."""

    def __init__(self, pids) -> None:
        super().__init__(daemon=True)
        self.pids, self.peaks, self._done = pids, {}, threading.Event()

    def run(self) -> None:
        while not self._done.wait(0.005):
            for pid in self.pids():
                for key, value in status_kib(pid).items():
                    self.peaks[(pid, key)] = max(self.peaks.get((pid, key), 0), value)

    def stop(self) -> dict:
        self._done.set()
        self.join()
        return self.peaks


def measure(way: str, target: str, device: str, degree: int) -> dict:
    """Runs in the child: load ``target`` the ``way`` way and report the peaks in MiB."""
    import torch

    torch.set_num_threads(1)
    followers: list[int] = []
    me = os.getpid()
    sampler = PeakSampler(lambda: [me, *followers])
    sampler.start()
    started = time.perf_counter()
    if way == "to-device":
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).to(device)
    elif way == "device-map":
        from draftfeed.consumers.engines.hf import HFEngine

        model = HFEngine(target, device=device, dtype="float32")
    else:
        from draftfeed.consumers.engines.parallel.engine import TensorParallelEngine

        devices = ["cpu"] * degree if device == "cpu" else [f"cuda:{i}" for i in range(degree)]
        model = TensorParallelEngine("hf", target, devices, "float32")
        followers.extend(model.pids[1:])
    seconds = time.perf_counter() - started
    time.sleep(0.05)
    peaks = sampler.stop()
    report = {"way": way, "load_s": round(seconds, 2)}
    for key in FIELDS:
        report[f"{key}_MiB"] = round(peaks.get((me, key), 0) / 1024)
        if followers:
            report[f"follower_{key}_MiB"] = round(max(peaks.get((pid, key), 0) for pid in followers) / 1024)
    if hasattr(model, "close"):
        model.close()
    return report


def checkpoint_mib(target: str) -> float:
    return sum(f.stat().st_size for f in Path(target).glob("*.safetensors")) / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", default=None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--tensor-parallel", type=int, default=2)
    parser.add_argument("--measure", default=None, help=argparse.SUPPRESS)  # the child's part
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure, args.target, args.device, args.tensor_parallel)))
        return
    with tempfile.TemporaryDirectory() as folder:
        target = args.target
        if target is None:
            from draftfeed.tiny import build_tiny_target

            target = str(build_tiny_target(Path(folder) / "llama-1gb", num_hidden_layers=16, hidden_size=1024, vocab_size=32000))
        print(f"checkpoint: {checkpoint_mib(target):.0f} MiB at {target}, device {args.device}")
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        for way in ("to-device", "device-map", "tensor-parallel"):
            command = [sys.executable, __file__, "--measure", way, "--target", target, "--device", args.device]
            command += ["--tensor-parallel", str(args.tensor_parallel)]
            out = subprocess.run(command, capture_output=True, text=True, env=env, timeout=1800)
            lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
            print(lines[-1] if lines else f"{way}: failed\n{out.stderr[-2000:]}")


if __name__ == "__main__":
    main()
