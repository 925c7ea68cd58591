"""The nixl data plane end to end on CPU: real NIXL (UCX) agents in real broker, worker and rank processes.

Supervision written by the worker into the rank's registered receive slots must equal frames and the
in-process computation bit for bit, for both tasks and every supervision form; slots the user's tensors view
are never written again; the pool's bound is kept; faults fall back to frames and the pair is rebuilt."""

from __future__ import annotations

import gc
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import WORKER_ENV, Cluster, make_batch, reference_dspark, reference_eagle3, wait_until
from fake_pair_faults import EXIT_CODE
from reference import draft_vocab
from support.lines import wait_for_line
from support.planes import VOCAB, add_faulty_worker, check_batches, pairs_of

from draftfeed import RemoteDSparkTarget, RemoteEagle3Target
from draftfeed.dataplane.nixl.transport import unavailable
from draftfeed.dataplane.nixl.worker_writes import ARENAS

pytestmark = [pytest.mark.timeout(240), pytest.mark.skipif(unavailable() is not None, reason=f"NIXL: {unavailable()}")]
AUX = [1, 3, 4]
DSPARK_IDS = [1, 3, 4, 6, 7]
RANK_SCRIPT = str(Path(__file__).parent / "pair_rank.py")
SMALL = ["--nixl-min-bytes", "0"]  # the tiny target's answers are under the default: nixl for all of them
FAULTS = ["--service", "faults", "--data-plane", "nixl", *SMALL]  # a worker with a forced fault in its writes


def await_nixl(remote, cluster: Cluster, worker: str) -> None:
    """Answers go as frames while the pair opens: ask until it is ready on both sides."""
    warm_up = make_batch(1, 8, VOCAB, seed=99)

    def ready() -> bool:
        remote.generate_batch(**warm_up)
        return remote.data_planes().get(worker, "").startswith("nixl") and pairs_of(cluster, worker).get(remote.rank_id, {}).get("state") == "ready"

    wait_until(ready, what="the nixl pair, ready on both sides")


@pytest.fixture(scope="module")
def forms(tiny_target):
    """One worker per task and form, each forcing nixl."""
    cluster = Cluster()
    try:
        for service, flags in {
            "probs": [],
            "hidden": ["--supervision", "hidden"],
            "dspark": ["--task", "dspark"],
        }.items():
            cluster.add_worker(tiny_target, "--service", service, "--data-plane", "nixl", "--name", f"nixl-{service}", *SMALL, *flags)
        yield cluster
    finally:
        cluster.stop()


@pytest.mark.parametrize("service", ["probs", "hidden", "hidden-mapped", "dspark"])
def test_nixl_equals_frames_and_the_in_process_computation(forms, tiny_model, service):
    mapping = draft_vocab(300) if service == "hidden-mapped" else None
    service = service.removesuffix("-mapped")
    cls = RemoteDSparkTarget if service == "dspark" else RemoteEagle3Target
    worker = f"nixl-{service}"

    def expected_of(batch):
        if service == "dspark":
            return reference_dspark(tiny_model, batch, DSPARK_IDS)
        return reference_eagle3(tiny_model, batch, AUX) if mapping is None else None  # with a draft vocab: equal to frames

    with cls(forms.frontend, service, data_plane="auto") as over_nixl, cls(forms.frontend, service, data_plane="frames") as over_frames:
        for remote in (over_nixl, over_frames):
            remote.model_info()
            if mapping is not None:
                remote.set_vocab_mapping(*mapping)
        await_nixl(over_nixl, forms, worker)
        seeds = list(range(10, 18))
        before = over_nixl.connection_stats.received_over_nixl
        by_nixl = check_batches(over_nixl, tiny_model, seeds, expected_of)
        by_frames = check_batches(over_frames, tiny_model, seeds, expected_of)
        for a, b in zip(by_nixl, by_frames):
            for field, tensor in b.as_dict().items():
                assert torch.equal(a.as_dict()[field], tensor), f"{field}: nixl and frames differ"
        assert over_nixl.connection_stats.received_over_nixl - before == len(seeds), "every answer came over nixl"
        assert over_frames.connection_stats.received_over_nixl == 0
        pair = pairs_of(forms, worker)[over_nixl.rank_id]
        assert pair["plane"] == "nixl" and pair["state"] == "ready"
        assert pair["reason"].startswith("the worker asked for nixl: both have NIXL, on one machine")
        # A worker reports a new pair in its next heartbeat (once an interval): wait for it.
        frames_pair = wait_until(lambda: pairs_of(forms, worker).get(over_frames.rank_id), what="the frames pair in status")
        assert frames_pair["reason"] == "the rank asks for frames"


def test_a_held_batch_is_never_overwritten_and_the_pool_keeps_its_bound(forms, tiny_model, caplog):
    caplog.set_level(logging.WARNING, logger="draftfeed.producer")
    limit = 4 << 20  # room for about 8 answers of this size (448 KiB each, in slots of 64 KiB multiples)
    with RemoteEagle3Target(forms.frontend, "probs", data_plane="nixl", nixl_pool_bytes=limit) as remote:
        await_nixl(remote, forms, "nixl-probs")
        held = check_batches(remote, tiny_model, [500])[0]
        copy = {name: tensor.clone() for name, tensor in held.as_dict().items()}
        before = remote.connection_stats.received_over_nixl
        check_batches(remote, tiny_model, list(range(501, 541)), keep=False)
        assert remote.connection_stats.received_over_nixl - before == 40, "the later answers reused the free slots"
        for name, tensor in copy.items():
            assert torch.equal(held.as_dict()[name], tensor), f"{name} of a held batch changed"
        assert remote.nixl_pool()["taken"] >= 1 and remote.nixl_pool()["registered_bytes"] <= limit
        # Hold every batch: the pool fills, later answers come as frames, still exact, and the log names the setting.
        kept = check_batches(remote, tiny_model, list(range(600, 620)))
        pool = remote.nixl_pool()
        assert pool["registered_bytes"] <= limit, pool
        assert remote.connection_stats.received_over_nixl - before < 60, "some answers came as frames once the pool was full"
        assert any("nixl_pool_bytes=4194304" in r.getMessage() and "still viewed" in r.getMessage() for r in caplog.records)
        del kept, held
        gc.collect()
        wait_until(lambda: remote.nixl_pool()["taken"] == 0, what="the slots freed with the tensors over them")
        before = remote.connection_stats.received_over_nixl
        check_batches(remote, tiny_model, list(range(700, 705)))
        assert remote.connection_stats.received_over_nixl - before == 5, "nixl again once the slots were free"


def test_a_failed_write_goes_as_frames_and_the_pair_is_rebuilt(fast_cluster, tiny_target, tiny_model):
    worker = add_faulty_worker(fast_cluster, tiny_target, "fail:3", *FAULTS, "--name", "w-flaky")
    with RemoteEagle3Target(fast_cluster.frontend, "faults", data_plane="nixl") as remote:
        await_nixl(remote, fast_cluster, "w-flaky")
        check_batches(remote, tiny_model, list(range(6)))
        pair = wait_until(lambda: pairs_of(fast_cluster, "w-flaky").get(remote.rank_id, {}).get("fallbacks"), what="the fallback in status")
        # The failed answer, and the next one if it was already staged and posted on the same pair (one write in flight
        # per staging arena): each is asked for again and arrives as frames.
        assert 1 <= pair <= ARENAS, pair
        seed = iter(range(100, 200))

        def rebuilt() -> bool:
            check_batches(remote, tiny_model, [next(seed)])
            worker_side = pairs_of(fast_cluster, "w-flaky").get(remote.rank_id, {})
            return remote.data_planes().get("w-flaky") == "nixl 1" and worker_side.get("state") == "ready"

        wait_until(rebuilt, timeout_s=60, what="a new nixl pair, ready on both sides", poll_s=0.2)
        before = remote.connection_stats.received_over_nixl
        check_batches(remote, tiny_model, list(range(200, 204)))
        assert remote.connection_stats.received_over_nixl == before + 4, "the rebuilt pair carries the answers"
    assert worker.popen.poll() is None


def test_a_posted_write_that_fails_takes_the_pair_down_and_its_answer_is_asked_for_again(fast_cluster, tiny_target, tiny_model):
    worker = add_faulty_worker(fast_cluster, tiny_target, "late:3", *FAULTS, "--name", "w-late")
    with RemoteEagle3Target(fast_cluster.frontend, "faults", data_plane="nixl") as remote:
        await_nixl(remote, fast_cluster, "w-late")
        check_batches(remote, tiny_model, list(range(8)))
        wait_until(lambda: pairs_of(fast_cluster, "w-late").get(remote.rank_id, {}).get("fallbacks"), what="the torn-down pair in status")
        assert remote.connection_stats.lost_over_pair >= 1, "the answer whose write failed was asked for again"
        check_batches(remote, tiny_model, list(range(8, 12)))
    assert worker.popen.poll() is None


def test_a_worker_that_dies_after_its_write_loses_nothing(fast_cluster, tiny_target, tiny_model):
    doomed = add_faulty_worker(fast_cluster, tiny_target, "exit:3", *FAULTS, "--name", "w-doomed")
    with RemoteEagle3Target(fast_cluster.frontend, "faults", data_plane="nixl", prefetch_depth=2) as remote:
        remote.model_info()
        fast_cluster.add_worker(tiny_target, "--service", "faults", "--data-plane", "nixl", "--name", "w-healthy", *SMALL)
        # Batches go on, 8 at a time, until the doomed worker has made its 3rd NIXL write: on a loaded machine its pair
        # may open late (its first answers go as frames) and the healthy worker take most of the batches.
        start = 0
        while doomed.popen.poll() is None:
            assert start < 400, f"the doomed worker made no 3rd NIXL write in {start} batches"
            check_batches(remote, tiny_model, list(range(start, start + 8)))
            start += 8
        assert doomed.popen.wait(timeout=30) == EXIT_CODE, "the fault killed the worker between its write and its header"
        wait_until(lambda: "w-doomed" not in remote.data_planes(), timeout_s=10, what="the dead worker's pair closed")
        assert remote.connection_stats.duplicates_dropped == 0
        check_batches(remote, tiny_model, list(range(start, start + 4)))


def test_a_killed_rank_makes_the_worker_drop_its_agent_and_others_are_served(fast_cluster, tiny_target, tiny_model):
    worker = fast_cluster.add_worker(tiny_target, "--service", "faults", "--data-plane", "nixl", "--name", "w-survivor", *SMALL)
    rank = subprocess.Popen(
        [sys.executable, RANK_SCRIPT, fast_cluster.frontend, "faults", "nixl"], stdout=subprocess.PIPE, text=True, env={**os.environ, **WORKER_ENV}
    )
    try:
        assert rank.stdout is not None
        rank_name = rank.stdout.readline().split()[-1]
        wait_until(lambda: pairs_of(fast_cluster, "w-survivor").get(rank_name, {}).get("sent_over_pair", 0) > 2, what="answers over nixl")
        mark = worker.lines_seen
        rank.kill()
        rank.wait(timeout=10)
        # The broker finds the rank dead within its liveness window (1.6 s here); the worker drops the rank's agent.
        wait_until(lambda: rank_name not in pairs_of(fast_cluster, "w-survivor"), timeout_s=15, what="the dead rank's pair released")
        wait_for_line(worker, f"dropped the NIXL agent of rank {rank_name}", timeout_s=5, after=mark)
        with RemoteEagle3Target(fast_cluster.frontend, "faults", data_plane="nixl") as remote:
            await_nixl(remote, fast_cluster, "w-survivor")
            check_batches(remote, tiny_model, list(range(8)))
    finally:
        rank.kill()
        rank.wait(timeout=10)
        print("\n".join(worker.log_tail[-30:]))  # shown by pytest when the test fails
