"""A worker at --tensor-parallel 2 end to end against the same forward at degree 2 in this process, same run; and
the same worker over two hosts (network namespaces, bench/hosts.py: --nnodes 2, one process on each).

Both run the tiny Llama sharded by transformers' tensor-parallel plan over two processes (gloo on CPU), one thread
each; the in-process side is the EAGLE-3 task over draftfeed's tensor-parallel engine (this process rank 0), the
other a broker, a worker and its follower (on one host, or node 0 and node 1 on two, the broker and the rank on a
third). The ratio is in-process time over end-to-end time (goal: 0.9 or more).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import torch

from draftfeed.bench.harness import Row, last_json, probe, seconds_per_call, token_batch
from draftfeed.bench.hosts import Hosts, unavailable_reason
from draftfeed.processes import commands

DEGREE = 2
ROWS, TOKENS, VOCAB = 4, 256, 4096
MASTER_PORT = 29518


def run(quick: bool, workdir: Path) -> list[Row]:
    from draftfeed import RemoteEagle3Target
    from draftfeed.consumers.engines.parallel.engine import TensorParallelEngine
    from draftfeed.consumers.tasks.eagle3 import Eagle3Task
    from draftfeed.tiny import build_tiny_target

    target_dir = build_tiny_target(workdir / "tiny-tp", num_hidden_layers=8, hidden_size=256, vocab_size=VOCAB)
    batch = token_batch(ROWS, TOKENS, VOCAB)
    count = 5 if quick else 20
    os.environ["OMP_NUM_THREADS"] = "1"  # the follower's threads, as the worker's below
    torch.set_num_threads(1)
    engine = TensorParallelEngine("hf", str(target_dir), ["cpu"] * DEGREE, "float32")
    try:
        task = Eagle3Task(engine)
        in_process = seconds_per_call(lambda: task.compute(batch["input_ids"], batch["attention_mask"], batch["loss_mask"], None), count)
    finally:
        engine.close()
    broker = commands.start_broker(extra=["--log-level", "WARNING"])
    try:
        flags = ["--service", "tiny-tp", "--tensor-parallel", str(DEGREE), "--log-level", "WARNING"]
        worker = commands.start_worker(broker.ready["backend"], str(target_dir), *flags, env={"OMP_NUM_THREADS": "1"})
        try:
            with RemoteEagle3Target(broker.ready["frontend"], "tiny-tp", prefetch_depth=0) as target:
                remote = seconds_per_call(lambda: target.generate_batch(**batch), count)
        finally:
            worker.stop(timeout_s=30)
    finally:
        broker.stop()
    rows = [
        Row(
            "tensor parallel",
            f"tiny Llama H=256 B=4 S=256 over {DEGREE} processes, one batch at a time: in-process / end to end",
            in_process * 1000,
            remote * 1000,
            "ms",
            f"a worker at --tensor-parallel {DEGREE}, end to end",
            ">= 0.9",
        )
    ]
    if unavailable_reason() is None:
        two_hosts = _over_two_hosts(target_dir, count)
        rows.append(
            Row(
                "tensor parallel",
                "the same over two hosts (--nnodes 2, one process each; broker and rank on a third): in-process / end to end",
                in_process * 1000,
                two_hosts * 1000,
                "ms",
                f"a worker at --tensor-parallel {DEGREE} --nnodes 2, end to end",
                ">= 0.9",
            )
        )
    return rows


def _over_two_hosts(target_dir: Path, count: int) -> float:
    """Seconds a batch end to end, node 0 and node 1 of the worker on hosts of their own, the rank beside the broker."""
    with Hosts(["head", "node-0", "node-1"]) as hosts:
        started: list[commands.Process] = []
        try:
            broker = commands.start_broker(hosts.address("head"), extra=["--log-level", "WARNING"], prefix=hosts.command("head"))
            started.append(broker)
            master = f"{hosts.address('node-0')}:{MASTER_PORT}"
            flags = [
                "--service",
                "tiny-tp-nodes",
                "--tensor-parallel",
                str(DEGREE),
                "--nnodes",
                "2",
                "--master-addr",
                master,
                "--log-level",
                "WARNING",
            ]
            env = {"OMP_NUM_THREADS": "1"}
            # Side by side: node 1 is ready once it has joined node 0, node 0 once node 1's process has loaded.
            nodes: dict[int, commands.Process] = {}
            errors: list[BaseException] = []

            def start(node: int) -> None:
                try:
                    command = [*flags, "--node-rank", str(node)]
                    nodes[node] = commands.start_worker(
                        broker.ready["backend"], str(target_dir), *command, env=env, prefix=hosts.command(f"node-{node}")
                    )
                except BaseException as exc:  # raised below, on the bench's thread
                    errors.append(exc)

            threads = [threading.Thread(target=start, args=(node,)) for node in (0, 1)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(timeout=300)
            started += nodes.values()
            if errors:
                raise errors[0]
            rank = probe(
                ["timed-rank", broker.ready["frontend"], "tiny-tp-nodes", str(ROWS), str(TOKENS), str(VOCAB), str(count)],
                env=env,
                prefix=hosts.command("head"),
            )
            return last_json(rank)["seconds"]
        finally:
            for process in reversed(started):
                process.stop(timeout_s=30)
