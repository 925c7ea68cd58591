"""``draftfeed bench``: every scenario with real processes on loopback, each against a baseline measured
in the same run, reported as ratios (docs/performance.md explains each one)."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import zmq

from draftfeed.bench.synthetic import BYTES_PER_TOKEN, DRAFT_VOCAB, HIDDEN, tokens_for
from draftfeed.dataplane.tensor_codec import DTYPES, decode_tensors, encode_tensors, pack_tensors
from draftfeed.launch import processes
from draftfeed.schemas.messages import Result

HUGETLB = {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
MB = 1e6


@dataclass
class Row:
    scenario: str
    case: str
    value: float
    baseline: float
    unit: str
    baseline_name: str
    goal: str = ""

    @property
    def ratio(self) -> float:
        return self.value / self.baseline if self.baseline else float("nan")


def _best(fn: Callable[[], float], repeat: int) -> float:
    return min(fn() for _ in range(repeat))


# ---------------------------------------------------------------- 1. codec
def eagle3_dict(tokens: int) -> dict[str, torch.Tensor]:
    return {
        "aux_hidden_states": torch.randn(1, tokens, 3 * HIDDEN).to(torch.bfloat16),
        "target_probs": torch.rand(1, tokens, DRAFT_VOCAB),
        "position_mask": torch.ones(1, tokens, 1, dtype=torch.bool),
        "input_ids": torch.zeros(1, tokens, dtype=torch.int64),
        "loss_mask": torch.ones(1, tokens, dtype=torch.int64),
    }


def bench_codec(quick: bool) -> list[Row]:
    tokens = 512 if quick else 2048
    tensors = eagle3_dict(tokens)
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    flat = [t.reshape(-1).view(torch.uint8) for t in tensors.values()]
    target = torch.empty(nbytes, dtype=torch.uint8)
    target.fill_(0)  # prefaulted: memcpy at its best

    def memcpy() -> float:
        started = time.perf_counter()
        offset = 0
        for part in flat:
            target[offset : offset + part.numel()].copy_(part)
            offset += part.numel()
        return time.perf_counter() - started

    def encode() -> float:
        started = time.perf_counter()
        pack_tensors(Result, tensors, request_id=0, kind="eagle3", worker="w")
        return time.perf_counter() - started

    def blob_encode() -> float:
        started = time.perf_counter()
        blob = bytearray(nbytes)
        offset = 0
        for part in flat:
            blob[offset : offset + part.numel()] = part.numpy().data
            offset += part.numel()
        bytes(blob)
        return time.perf_counter() - started

    specs, buffers = encode_tensors(tensors)
    frames = [bytearray(b) for b in buffers]  # writable, as received zmq frames are

    def decode() -> float:
        started = time.perf_counter()
        decode_tensors(specs, frames)
        return time.perf_counter() - started

    blob = bytes(target.numpy())

    def blob_decode() -> float:
        started = time.perf_counter()
        raw = torch.frombuffer(bytearray(blob), dtype=torch.uint8)  # bytes are read-only: one copy
        offset = 0
        for spec in specs:
            size = spec.numel() * DTYPES[spec.dtype].itemsize
            raw[offset : offset + size].clone()
            offset += size
        return time.perf_counter() - started

    repeat = 3 if quick else 5
    t_memcpy = _best(memcpy, repeat)
    case = f"{nbytes / MB:.1f} MB EAGLE-3 dict"
    return [
        Row("codec", f"encode {case}", nbytes / _best(encode, repeat) / 1e9, nbytes / t_memcpy / 1e9, "GB/s", "memcpy", "sends copy nothing"),
        Row("codec", f"one-blob encode {case}", nbytes / _best(blob_encode, repeat) / 1e9, nbytes / t_memcpy / 1e9, "GB/s", "memcpy"),
        Row("codec", f"decode {case}", nbytes / _best(decode, repeat) / 1e9, nbytes / t_memcpy / 1e9, "GB/s", "memcpy", "receives copy at most once"),
        Row("codec", f"one-blob decode {case}", nbytes / _best(blob_decode, repeat) / 1e9, nbytes / t_memcpy / 1e9, "GB/s", "memcpy"),
    ]


# ---------------------------------------------------------------- helpers for process scenarios
def _probe(args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "draftfeed.bench.probes", *args],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
    )


def _last_json(popen: subprocess.Popen, timeout: float = 300) -> dict:
    out, _ = popen.communicate(timeout=timeout)
    if popen.returncode != 0:
        raise RuntimeError(f"probe exited with {popen.returncode}")
    return json.loads(out.strip().splitlines()[-1])


class Pipeline:
    """A broker and synthetic workers for one scenario; stopped on exit."""

    def __init__(self, workers: int, tokens: int, compute_ms: float, capacity: int = 2, data_plane: str = "auto", keys: Path | None = None) -> None:
        self.started: list[processes.Process] = []
        secure = ["--secure", "--keys", str(keys)] if keys is not None else []
        self.broker = processes.start_broker(extra=["--log-level", "WARNING", *secure])
        self.started.append(self.broker)
        for index in range(workers):
            self.started.append(
                processes.start(
                    [
                        "--broker",
                        self.broker.ready["backend"],
                        "--service",
                        "bench",
                        "--tokens",
                        str(tokens),
                        "--compute-ms",
                        str(compute_ms),
                        "--capacity",
                        str(capacity),
                        "--name",
                        f"synthetic-{index}",
                        "--data-plane",
                        data_plane,
                        *(["--keys", str(keys)] if keys is not None else []),
                    ],
                    module="draftfeed.bench.synthetic",
                )
            )

    @property
    def frontend(self) -> str:
        return self.broker.ready["frontend"]

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc: object) -> None:
        for process in reversed(self.started):
            process.stop(timeout_s=10)


# ---------------------------------------------------------------- 2. data plane
def raw_rate(nbytes: int, count: int, env: dict[str, str] | None) -> dict:
    receiver = _probe(["raw-recv", str(nbytes), str(count)], env)
    assert receiver.stdout is not None
    endpoint = json.loads(receiver.stdout.readline())["endpoint"]
    sender = _probe(["raw-send", endpoint, str(nbytes), str(count)])
    result = _last_json(receiver)
    sender.communicate(timeout=120)
    return result


def bench_data_plane(quick: bool) -> list[Row]:
    sizes = [16, 64] if quick else [16, 64, 256, 312.5]
    rows = []
    for size_mb in sizes:
        tokens = tokens_for(int(size_mb * MB))
        nbytes = tokens * BYTES_PER_TOKEN
        count = max(4, int((400 if quick else 2000) / size_mb))
        with Pipeline(workers=1, tokens=tokens, compute_ms=0) as pipeline:
            for label, env in (("", None), (" + hugetlb", HUGETLB)):
                raw = raw_rate(nbytes, count, env)
                ours = _last_json(_probe(["rank", pipeline.frontend, "bench", str(tokens), str(count), "2"], env))
                rows.append(
                    Row(
                        "data plane",
                        f"{size_mb:g} MB worker -> rank{label} ({ours['faults_per_msg']:.0f} page faults/msg)",
                        ours["bytes_per_s"] / 1e9,
                        raw["bytes_per_s"] / 1e9,
                        "GB/s",
                        f"raw pyzmq DEALER->ROUTER{label}",
                        ">= 0.8",
                    )
                )
    return rows


def raw_gloo_rate(nbytes: int, count: int) -> dict:
    receiver = _probe(["raw-gloo-recv", str(nbytes), str(count)])
    assert receiver.stdout is not None
    port = json.loads(receiver.stdout.readline())["port"]
    sender = _probe(["raw-gloo-send", str(port), str(nbytes), str(count)])
    result = _last_json(receiver)
    sender.communicate(timeout=120)
    return result


def bench_pair_plane(quick: bool) -> list[Row]:
    """Supervision on a gloo pair group against frames through the same pipeline, and against raw gloo."""
    sizes = [16, 64] if quick else [16, 64, 256]
    rows = []
    for size_mb in sizes:
        tokens = tokens_for(int(size_mb * MB))
        nbytes = tokens * BYTES_PER_TOKEN
        count = max(4, int((300 if quick else 1500) / size_mb))
        with Pipeline(workers=1, tokens=tokens, compute_ms=0, data_plane="gloo") as pipeline:
            over_frames = _last_json(_probe(["rank", pipeline.frontend, "bench", str(tokens), str(count), "2", "frames"]))
            over_pair = _last_json(_probe(["rank", pipeline.frontend, "bench", str(tokens), str(count), "2", "gloo"]))
        if over_pair["received_over_pair"] < count:
            raise RuntimeError(f"only {over_pair['received_over_pair']} of {count} answers came on the gloo group")
        raw = raw_gloo_rate(nbytes, count)
        case = f"{size_mb:g} MB worker -> rank on a gloo pair group"
        rows.append(
            Row(
                "pair plane",
                f"{case}, against frames",
                over_pair["bytes_per_s"] / 1e9,
                over_frames["bytes_per_s"] / 1e9,
                "GB/s",
                "frames plane, same pipeline",
            )
        )
        rows.append(
            Row(
                "pair plane",
                f"{case}, against raw gloo",
                over_pair["bytes_per_s"] / 1e9,
                raw["bytes_per_s"] / 1e9,
                "GB/s",
                "raw gloo send/recv of one tensor",
                ">= 0.8",
            )
        )
    return rows


def bench_encryption(quick: bool, workdir: Path) -> list[Row]:
    """Supervision and small requests through a --secure pipeline (CURVE everywhere) against the same pipeline
    in plaintext, in the same run."""
    from draftfeed.security.keys import generate

    keys = workdir / "bench-keys"
    if not (keys / "broker.key_secret").exists():
        generate(keys)
    rows = []
    for size_mb in [16] if quick else [16, 64]:
        tokens = tokens_for(int(size_mb * MB))
        count = max(4, int((300 if quick else 1500) / size_mb))
        rates = {}
        for label, folder in (("plaintext", None), ("curve", keys)):
            with Pipeline(workers=1, tokens=tokens, compute_ms=0, keys=folder) as pipeline:
                env = {"DRAFTFEED_KEYS": str(folder)} if folder else None
                rates[label] = _last_json(_probe(["rank", pipeline.frontend, "bench", str(tokens), str(count), "2", "frames"], env))["bytes_per_s"]
        rows.append(
            Row(
                "encryption",
                f"{size_mb:g} MB supervision, CURVE",
                rates["curve"] / 1e9,
                rates["plaintext"] / 1e9,
                "GB/s",
                "the same pipeline in plaintext",
            )
        )
    count = 1000 if quick else 5000
    rates = {}
    for label, folder in (("plaintext", None), ("curve", keys)):
        with Pipeline(workers=2, tokens=1, compute_ms=0, capacity=32, keys=folder) as pipeline:
            env = {"DRAFTFEED_KEYS": str(folder)} if folder else None
            rates[label] = _last_json(_probe(["rank", pipeline.frontend, "bench", "1", str(count), "32", "frames"], env))["seconds"]
    rows.append(
        Row(
            "encryption",
            "1-token requests, CURVE",
            count / rates["curve"],
            count / rates["plaintext"],
            "requests/s",
            "the same pipeline in plaintext",
        )
    )
    return rows


# ---------------------------------------------------------------- 3. broker
def bench_broker(quick: bool) -> list[Row]:
    count = 2000 if quick else 20000
    with Pipeline(workers=2, tokens=1, compute_ms=0, capacity=32) as pipeline:
        from draftfeed import RemoteEagle3Target

        batch = {k: torch.zeros(1, 1, dtype=torch.int64) for k in ("input_ids", "attention_mask", "loss_mask")}
        with RemoteEagle3Target(pipeline.frontend, "bench", prefetch_depth=64) as target:
            target.model_info()
            latencies = []
            for _ in range(100 if quick else 1000):
                started = time.perf_counter()
                target.generate_batch(**batch)
                latencies.append(time.perf_counter() - started)
            started = time.perf_counter()
            for _ in target.iterate(batch for _ in range(count)):
                pass
            rate = count / (time.perf_counter() - started)
    broker = processes.start_broker(extra=["--log-level", "WARNING"])
    try:
        worker = _probe(["raw-worker", broker.ready["backend"], str(count)])
        routed = _last_json(_probe(["raw-rank", broker.ready["frontend"], str(count), "64"]))["requests_per_s"]
        worker.communicate(timeout=60)
    finally:
        broker.stop()
    echo_rate, echo_latencies = _echo_baseline(count, 100 if quick else 1000)
    p50, p99 = statistics.median(latencies), sorted(latencies)[int(0.99 * len(latencies))]
    e50, e99 = statistics.median(echo_latencies), sorted(echo_latencies)[int(0.99 * len(echo_latencies))]
    return [
        Row(
            "broker",
            "requests routed per second by the broker alone (raw-pyzmq rank and worker)",
            routed,
            echo_rate,
            "req/s",
            "direct DEALER->ROUTER echo",
            ">= 20,000",
        ),
        Row("broker", "requests per second end to end (draftfeed rank, 2 synthetic workers)", rate, echo_rate, "req/s", "direct DEALER->ROUTER echo"),
        Row("broker", "request latency p50", p50 * 1e6, e50 * 1e6, "us", "direct echo p50"),
        Row("broker", "request latency p99", p99 * 1e6, e99 * 1e6, "us", "direct echo p99"),
    ]


_ECHO_SERVER = """
import sys, zmq
ctx = zmq.Context(); s = ctx.socket(zmq.ROUTER); s.setsockopt(zmq.LINGER, 0)
port = s.bind_to_random_port("tcp://127.0.0.1"); print(port, flush=True)
while True:
    frames = s.recv_multipart()
    if frames[1] == b"stop":
        break
    s.send_multipart(frames)
"""


def _echo_baseline(count: int, singles: int) -> tuple[float, list[float]]:
    server = subprocess.Popen([sys.executable, "-c", _ECHO_SERVER], stdout=subprocess.PIPE, text=True)
    assert server.stdout is not None
    port = int(server.stdout.readline())
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{port}")
    try:
        latencies = []
        for _ in range(singles):
            started = time.perf_counter()
            sock.send(b"x")
            sock.recv()
            latencies.append(time.perf_counter() - started)
        started = time.perf_counter()
        window, sent, received = 64, 0, 0
        while received < count:
            while sent < count and sent - received < window:
                sock.send(b"x")
                sent += 1
            sock.recv()
            received += 1
        rate = count / (time.perf_counter() - started)
        sock.send(b"stop")
    finally:
        sock.close(0)
        context.term()
        server.wait(10)
    return rate, latencies


# ---------------------------------------------------------------- 4. overlap
def bench_overlap(quick: bool) -> list[Row]:
    from draftfeed import RemoteEagle3Target

    steps, step_s, compute_ms = (20, 0.03, 20) if quick else (60, 0.03, 20)
    rows = []
    with Pipeline(workers=1, tokens=64, compute_ms=compute_ms) as pipeline:
        batch = {k: torch.zeros(1, 64, dtype=torch.int64) for k in ("input_ids", "attention_mask", "loss_mask")}
        for depth in (0, 1, 2, 4):
            with RemoteEagle3Target(pipeline.frontend, "bench", prefetch_depth=depth) as target:
                target.model_info()
                batches = target.iterate(batch for _ in range(steps + 1))
                next(batches)  # the first batch cannot have been prefetched: steady state starts after it
                waited = 0.0
                started = mark = time.perf_counter()
                for _ in batches:
                    waited += time.perf_counter() - mark
                    time.sleep(step_s)  # the training step
                    mark = time.perf_counter()
                total = time.perf_counter() - started
            rows.append(
                Row(
                    "overlap",
                    f"depth {depth}: the training loop waits, steady state (step {step_s * 1000:.0f} ms, worker {compute_ms} ms)",
                    100 * waited / total,
                    100.0,
                    "% of time",
                    "waiting the whole time",
                    "< 2% at depth >= 2",
                )
            )
    return rows


# ---------------------------------------------------------------- 5. scaling
def bench_scaling(quick: bool) -> list[Row]:
    from draftfeed import RemoteEagle3Target

    compute_ms, count = 50, (30 if quick else 120)
    batch = {k: torch.zeros(1, 16, dtype=torch.int64) for k in ("input_ids", "attention_mask", "loss_mask")}
    rows, single = [], None
    for workers in (1, 2, 4):
        with Pipeline(workers=workers, tokens=16, compute_ms=compute_ms, capacity=2) as pipeline:
            with RemoteEagle3Target(pipeline.frontend, "bench", prefetch_depth=2 * workers) as target:
                target.model_info()
                started = time.perf_counter()
                for _ in target.iterate(batch for _ in range(count)):
                    pass
                rate = count / (time.perf_counter() - started)
        single = single or rate
        rows.append(Row("scaling", f"{workers} synthetic workers ({compute_ms} ms each)", rate, single * workers, "batches/s", "ideal linear"))
    return rows


# ---------------------------------------------------------------- 6. real target
def bench_real_target(quick: bool, workdir: Path) -> list[Row]:
    from draftfeed import RemoteEagle3Target
    from draftfeed.consumers.engines.hf import HFEngine
    from draftfeed.consumers.tasks.eagle3 import Eagle3Task
    from draftfeed.tiny import build_tiny_target

    target_dir = build_tiny_target(workdir / "tiny", num_hidden_layers=8, hidden_size=128, vocab_size=4096)
    generator = torch.Generator().manual_seed(0)
    batch = {"input_ids": torch.randint(0, 4096, (4, 256), generator=generator)}
    batch["attention_mask"] = torch.ones_like(batch["input_ids"])
    batch["loss_mask"] = batch["attention_mask"].clone()
    count = 10 if quick else 40
    torch.set_num_threads(1)
    task = Eagle3Task(HFEngine(str(target_dir)))
    task.compute(batch["input_ids"], batch["attention_mask"], batch["loss_mask"], None)
    started = time.perf_counter()
    for _ in range(count):
        task.compute(batch["input_ids"], batch["attention_mask"], batch["loss_mask"], None)
    in_process = (time.perf_counter() - started) / count
    broker = processes.start_broker(extra=["--log-level", "WARNING"])
    try:
        worker = processes.start_worker(
            broker.ready["backend"], str(target_dir), "--service", "tiny", "--log-level", "WARNING", env={"OMP_NUM_THREADS": "1"}
        )
        try:
            with RemoteEagle3Target(broker.ready["frontend"], "tiny", prefetch_depth=0) as target:
                target.generate_batch(**batch)
                started = time.perf_counter()
                for _ in range(count):
                    target.generate_batch(**batch)
                remote = (time.perf_counter() - started) / count
        finally:
            worker.stop()
    finally:
        broker.stop()
    return [
        Row(
            "real target",
            "tiny Llama B=4 S=256, one batch at a time: in-process / end to end",
            in_process * 1000,
            remote * 1000,
            "ms",
            "end to end through the pipeline",
        )
    ]


SCENARIOS = {
    "codec": lambda quick, workdir: bench_codec(quick),
    "data-plane": lambda quick, workdir: bench_data_plane(quick),
    "pair-plane": lambda quick, workdir: bench_pair_plane(quick),
    "encryption": bench_encryption,
    "broker": lambda quick, workdir: bench_broker(quick),
    "overlap": lambda quick, workdir: bench_overlap(quick),
    "scaling": lambda quick, workdir: bench_scaling(quick),
    "real-target": bench_real_target,
}


def format_table(rows: list[Row]) -> str:
    lines = [f"{'scenario':<12} {'case':<72} {'value':>12} {'baseline':>12} {'ratio':>7}  unit / baseline", "-" * 150]
    for row in rows:
        lines.append(
            f"{row.scenario:<12} {row.case:<72} {row.value:>12,.3f} {row.baseline:>12,.3f} {row.ratio:>7.2f}  {row.unit} / {row.baseline_name}{'  goal ' + row.goal if row.goal else ''}"
        )
    return "\n".join(lines)


def run(scenarios: list[str], quick: bool, workdir: Path, progress: Callable[[str], None] = print) -> list[Row]:
    rows: list[Row] = []
    for name in scenarios:
        progress(f"running {name} ...")
        rows.extend(SCENARIOS[name](quick, workdir))
    return rows


def to_json(rows: list[Row], quick: bool) -> dict:
    return {
        "quick": quick,
        "machine": {"cpus": os.cpu_count(), "torch": torch.__version__, "pyzmq": zmq.__version__, "libzmq": zmq.zmq_version()},
        "rows": [{**asdict(row), "ratio": row.ratio} for row in rows],
    }
