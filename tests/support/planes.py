"""Data planes end to end (test_data_planes.py, test_nixl_plane.py): a worker's pairs as status reports them, a
worker with a forced fault in its sends (fake_pair_faults.py), and batches checked against the in-process computation."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from conftest import WORKER_ENV, Cluster, assert_supervision_equal, make_batch, reference_eagle3

from draftfeed.processes import commands

VOCAB = 1000  # the tiny target's


def pairs_of(cluster: Cluster, worker: str) -> dict[str, dict]:
    """The worker's pairs as status reports them, by rank."""
    status = cluster.worker_status(worker)
    return {pair["rank"]: pair for pair in (status or {}).get("pairs", [])}


def add_faulty_worker(cluster: Cluster, target: Path | str, fault: str, *args: str) -> commands.Process:
    """A real worker (the worker ``args``) whose N-th send fails as ``fault`` (``KIND:N``) says: its NIXL writes
    (FAKE_NIXL_FAULT) with ``--data-plane nixl``, else its sends on pair groups (FAKE_PAIR_FAULT)."""
    nixl = "nixl" in [value for flag, value in zip(args, args[1:]) if flag == "--data-plane"]
    worker = commands.start(
        ["worker", "--broker", cluster.backend, "--target", str(target), *args],
        env={**WORKER_ENV, "FAKE_NIXL_FAULT" if nixl else "FAKE_PAIR_FAULT": fault},
        module="fake_pair_faults",
    )
    cluster.workers.append(worker)
    return worker


def check_batches(remote, model, seeds: list[int], expected_of: Callable | None = None, keep: bool = True) -> list:
    """Iterate batches of these seeds (3 rows of 32 tokens); the answers must come each once, in the dataloader's order,
    and each equal ``expected_of(batch)``: by default the in-process EAGLE-3 computation with the target's aux layers;
    when it returns None, the answer is not compared. Returns the answers (``keep``), or drops each once checked,
    as a training loop does."""
    if expected_of is None:
        aux = remote.model_info().aux_layer_ids

        def expected_of(batch: dict):
            return reference_eagle3(model, batch, aux)

    batches = [make_batch(3, 32, VOCAB, seed=seed) | {"seed": seed} for seed in seeds]
    answers, seen = [], []
    for batch, supervision in remote.iterate(batches):
        seen.append(batch["seed"])
        expected = expected_of(batch)
        if expected is not None:
            assert_supervision_equal(supervision, expected)
        if keep:
            answers.append(supervision)
        del supervision
    assert seen == seeds, "each batch exactly once, in the dataloader's order"
    return answers
