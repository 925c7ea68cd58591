"""Weight updates (docs/versions.md): the time from ``publish_weights`` to the first batch served at the new version,
against restarting the worker from the same weights (stop it, start one with ``--target-version``, its first batch),
for a target of about 1 GB on CPU; and the time until the worker has the update against raw pyzmq (raw NIXL) moving
the same bytes between two processes, the least the plane's bytes take. The first update of a worker's life is shown
apart: until then its weights are the checkpoint file's pages, which the loader maps copy-on-write, and the first
write into each page copies it (a page fault each 4 KiB), so it is slower than every later one, which is what an RL
loop pays each step. Then a rank's waits under ``version_policy="latest"`` with two workers (each on one core, as on a
device of its own): its longest wait for a batch while a publisher updates them every 8 batches, one at a time
(``at_once=1``: the other serves meanwhile), against the same loop with no updates.

The target is a random-weight Llama (draftfeed.tiny) of 16 layers of width 1024 in float32; the update is every tensor
of it (its state dict, held by the bench's process), published in the default 16 MiB pieces, as frames and, where
NIXL is installed, read over NIXL; the raw baselines move the same bytes in messages (writes) of that size.
"""

from __future__ import annotations

import time
from pathlib import Path

from draftfeed.bench.harness import Row
from draftfeed.bench.scenarios.data_plane import raw_rate
from draftfeed.bench.scenarios.nixl_plane import raw_nixl_rate
from draftfeed.dataplane.nixl.transport import unavailable
from draftfeed.processes import commands
from draftfeed.schemas.protocol import DEFAULT_TRANSFER_CHUNK_BYTES

SERVICE = "updates"
LAYERS, HIDDEN, VOCAB = 16, 1024, 32000
EVERY, WARM = 8, 4  # batches between two updates under latest; batches before the waits are measured
ONE_CORE = {"OMP_NUM_THREADS": "1"}  # each worker computes on one core, as on a device of its own


def run(quick: bool, workdir: Path) -> list[Row]:
    import torch

    from draftfeed import RemoteDSparkTarget
    from draftfeed.consumers.weight_updates import read_update
    from draftfeed.tiny import build_tiny_target

    layers = 4 if quick else LAYERS
    target = build_tiny_target(workdir / "update-target", num_hidden_layers=layers, hidden_size=HIDDEN, vocab_size=VOCAB)
    weights = read_update(str(target))  # every tensor of the checkpoint, as a worker reads an update
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())
    batch = {"input_ids": torch.arange(64).unsqueeze(0) % VOCAB, "attention_mask": torch.ones(1, 64, dtype=torch.int64)}
    batch["loss_mask"] = batch["attention_mask"].clone()
    flags = ("--service", SERVICE, "--task", "dspark", "--target-layer-ids", f"1,{layers - 1}")
    broker = commands.start_broker(extra=["--log-level", "WARNING"])
    worker = commands.start_worker(broker.ready["backend"], str(target), *flags, "--log-level", "WARNING", env=ONE_CORE)
    rows: list[Row] = []
    workers = [worker]
    nixl = unavailable() is None
    try:
        with RemoteDSparkTarget(broker.ready["frontend"], SERVICE, prefetch_depth=0) as rank:
            rank.generate_batch(**batch)  # warm
            _, first_s = _publish_then_serve(broker.ready["frontend"], rank, weights, batch, 1, nixl=False)
            frames_answered_s, frames_s = _publish_then_serve(broker.ready["frontend"], rank, weights, batch, 2, nixl=False)
            nixl_answered_s = nixl_s = None
            if nixl:  # the first registers the trainer's memory with NIXL for the first time: the second is an RL step's
                _publish_then_serve(broker.ready["frontend"], rank, weights, batch, 3, nixl=True)
                nixl_answered_s, nixl_s = _publish_then_serve(broker.ready["frontend"], rank, weights, batch, 4, nixl=True)
        started = time.perf_counter()
        worker.stop()
        worker = commands.start_worker(broker.ready["backend"], str(target), *flags, "--target-version", "5", "--log-level", "WARNING", env=ONE_CORE)
        workers = [worker]
        with RemoteDSparkTarget(broker.ready["frontend"], SERVICE, prefetch_depth=0, min_target_version=5) as rank:
            rank.generate_batch(**batch)
        restart_s = time.perf_counter() - started
        gb = nbytes / 1e9
        best_s, best_plane = (nixl_s, "nixl") if nixl_s is not None else (frames_s, "frames")
        rows.append(
            Row(
                "updates",
                f"publish_weights to the first batch at the new version, {gb:.2f} GB target (a later update, {best_plane})",
                best_s,
                restart_s,
                "s",
                "restarting the worker",
                "<= 0.2",
            )
        )
        rows.append(
            Row("updates", f"the same, the first update of the worker's life, {gb:.2f} GB (frames)", first_s, restart_s, "s", "restarting the worker")
        )
        raw = raw_rate(DEFAULT_TRANSFER_CHUNK_BYTES, -(-nbytes // DEFAULT_TRANSFER_CHUNK_BYTES), None)
        rows.append(
            Row(
                "updates",
                f"publish_weights until the worker has the update, {gb:.2f} GB, frames",
                frames_answered_s,
                nbytes / raw["bytes_per_s"],
                "s",
                "raw pyzmq moving the bytes",
            )
        )
        if nixl_answered_s is not None:
            raw = raw_nixl_rate(workdir, DEFAULT_TRANSFER_CHUNK_BYTES, -(-nbytes // DEFAULT_TRANSFER_CHUNK_BYTES), None, sender=(), receiver=())
            rows.append(
                Row(
                    "updates",
                    f"publish_weights until the worker has the update, {gb:.2f} GB, nixl",
                    nixl_answered_s,
                    nbytes / raw["bytes_per_s"],
                    "s",
                    "raw NIXL writes of the bytes",
                )
            )
        workers.append(
            commands.start_worker(broker.ready["backend"], str(target), *flags, "--target-version", "5", "--log-level", "WARNING", env=ONE_CORE)
        )
        from draftfeed import publish_weights

        publish_weights(broker.ready["frontend"], SERVICE, weights, 6)  # each worker's first update (shown apart above)
        rows.extend(_latest_waits(broker.ready["frontend"], weights, batch, 6 if quick else 24))
    finally:
        for started_worker in workers:
            started_worker.stop()
        broker.stop()
    return rows


def _publish_then_serve(frontend: str, rank, weights: dict, batch: dict, version: int, nixl: bool) -> tuple[float, float]:
    """Seconds from ``publish_weights`` of ``version`` (over NIXL or frames) until it returned (the worker has the
    update), and until the rank's first batch computed at it."""
    from draftfeed import publish_weights

    started = time.perf_counter()
    report = publish_weights(frontend, SERVICE, weights, version, nixl=nixl)
    answered = time.perf_counter() - started
    rank.want_target_version(version)
    served = rank.generate_batch(**batch)
    assert report.workers[0].ok and served.target_version == version, report
    return answered, time.perf_counter() - started


def _latest_waits(frontend: str, weights: dict, batch: dict, steps: int) -> list[Row]:
    """The rank's longest wait for a batch under ``latest`` while the weights are published every ``EVERY`` batches
    (by a thread of this process, as a trainer beside it would) to the two workers one at a time, against the same loop
    without updates; each loop after ``WARM`` batches that open the rank's pairs to the workers."""
    import threading

    from draftfeed import RemoteDSparkTarget, publish_weights

    def longest(updating: bool) -> float:
        with RemoteDSparkTarget(frontend, SERVICE, prefetch_depth=2, version_policy="latest") as rank:
            for _ in range(WARM):
                rank.generate_batch(**batch)
            worst, threads = 0.0, []
            for step in range(steps):
                if updating and step % EVERY == 0:
                    version = 10 + step
                    publish = lambda version=version: publish_weights(frontend, SERVICE, weights, version, at_once=1)  # noqa: E731
                    threads.append(threading.Thread(target=publish, daemon=True))
                    threads[-1].start()
                started = time.perf_counter()
                rank.generate_batch(**batch)
                worst = max(worst, time.perf_counter() - started)
            for thread in threads:
                thread.join(120)
        return worst

    quiet, updated = longest(False), longest(True)
    return [
        Row(
            "updates",
            f"a rank's longest wait for a batch under latest, two workers updated one at a time every {EVERY} batches",
            updated,
            quiet,
            "s",
            "the same loop without updates",
            "<= 1",
        )
    ]
