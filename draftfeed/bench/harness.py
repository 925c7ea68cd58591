"""What every bench scenario shares: the result row, best-of timing, probe processes, a synthetic pipeline,
and the run that turns chosen scenarios into the table and the JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import zmq

from draftfeed.bench.scenarios import load
from draftfeed.processes import children, commands

MB = 1e6


@dataclass
class Row:
    """One measured case beside its baseline from the same run."""

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


def best_of(fn: Callable[[], float], repeat: int) -> float:
    """The fastest of ``repeat`` timings."""
    return min(fn() for _ in range(repeat))


def seconds_per_call(call: Callable[[], object], count: int) -> float:
    """``call()`` once to warm up, then the mean wall time of ``count`` more."""
    call()
    started = time.perf_counter()
    for _ in range(count):
        call()
    return (time.perf_counter() - started) / count


def token_batch(batch_size: int, seq_len: int, vocab_size: int) -> dict[str, Any]:
    """A full batch of random token ids (no padding), the same in every run: a real target's request."""
    generator = torch.Generator().manual_seed(0)
    batch = {"input_ids": torch.randint(0, vocab_size, (batch_size, seq_len), generator=generator)}
    batch["attention_mask"] = torch.ones_like(batch["input_ids"])
    batch["loss_mask"] = batch["attention_mask"].clone()
    return batch


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time a process has used so far (Linux /proc), for per-message costs."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def probe(args: list[str], env: dict[str, str] | None = None, prefix: Sequence[str] = ()) -> subprocess.Popen:
    """Start ``python -m draftfeed.bench.probes ARGS`` with its stdout piped (through ``prefix``: on another host); it
    dies with the bench (``children.spawn``)."""
    return children.spawn(
        [*prefix, sys.executable, "-m", "draftfeed.bench.probes", *args],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
    )


def last_json(popen: subprocess.Popen, timeout: float = 300) -> dict:
    """Wait for a probe and read the JSON on its last line."""
    out, _ = popen.communicate(timeout=timeout)
    if popen.returncode != 0:
        raise RuntimeError(f"probe exited with {popen.returncode}")
    return json.loads(out.strip().splitlines()[-1])


class Pipeline:
    """A broker and synthetic workers for one scenario; stopped on exit."""

    def __init__(
        self,
        workers: int,
        tokens: int,
        compute_ms: float,
        capacity: int = 2,
        data_plane: str = "auto",
        keys: Path | None = None,
        host: str = "127.0.0.1",
        prefix: Sequence[str] = (),
        env: dict[str, str] | None = None,
    ) -> None:
        """``host``, ``prefix``: the address the broker binds and the command that runs broker and workers on it
        (another network namespace); ``env`` for the workers."""
        self.started: list[commands.Process] = []
        secure = ["--secure", "--keys", str(keys)] if keys is not None else []
        self.broker = commands.start_broker(host, extra=["--log-level", "WARNING", *secure], prefix=prefix)
        self.started.append(self.broker)
        for index in range(workers):
            self.started.append(
                commands.start(
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
                    prefix=prefix,
                    env=env,
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


def format_table(rows: list[Row]) -> str:
    lines = [f"{'scenario':<12} {'case':<72} {'value':>12} {'baseline':>12} {'ratio':>7}  unit / baseline", "-" * 150]
    for row in rows:
        lines.append(
            f"{row.scenario:<12} {row.case:<72} {row.value:>12,.3f} {row.baseline:>12,.3f} {row.ratio:>7.2f}  {row.unit} / {row.baseline_name}{'  goal ' + row.goal if row.goal else ''}"
        )
    return "\n".join(lines)


def run(names: Sequence[str], quick: bool, workdir: Path, settings: Sequence[Any] = ()) -> list[Row]:
    """The rows of each named scenario, in the order given, with their progress on stderr; a scenario whose
    ``SETTINGS`` class is among ``settings`` gets that object."""
    from draftfeed.progress import Progress

    rows: list[Row] = []
    progress = Progress(len(names), "bench scenarios", every_s=0.0)
    for name in names:
        progress.write(f"running {name} ...")
        module = load(name)
        own = [item for item in settings if type(item) is getattr(module, "SETTINGS", None)]
        rows.extend(module.run(quick, workdir, settings=own[0]) if own else module.run(quick, workdir))
        progress.advance(note=f"{name} done")
    progress.close()
    return rows


def to_json(rows: list[Row], quick: bool) -> dict:
    return {
        "quick": quick,
        "machine": {"cpus": os.cpu_count(), "torch": torch.__version__, "pyzmq": zmq.__version__, "libzmq": zmq.zmq_version()},
        "rows": [{**asdict(row), "ratio": row.ratio} for row in rows],
    }
