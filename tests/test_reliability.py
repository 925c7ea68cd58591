"""Worker faults with real processes: workers killed (SIGKILL), frozen, joining, leaving (SIGTERM), out of memory.

The promise under test: every rank receives the supervision of every batch it sent exactly once, in
its order, equal to the in-process computation, as long as some worker eventually serves its service.
"""

from __future__ import annotations

import signal

import pytest
from conftest import assert_supervision_equal, make_batch, reference_eagle3, wait_until
from fake_engines import CRASH_MARKER, OOM_MARKER
from rank_run import SERVICE, SLOW, RankRun, batches

from draftfeed import RemoteEagle3Target, RemoteTargetError

pytestmark = pytest.mark.timeout(240)


def test_worker_killed_holding_requests_is_replaced(fast_cluster, tiny_target, tiny_model):
    victim = fast_cluster.add_worker(tiny_target, *SLOW, "--name", "victim")
    fast_cluster.add_worker(tiny_target, *SLOW, "--name", "survivor")
    rank = RankRun(fast_cluster.frontend, batches(16), depth=4)
    rank.start()
    wait_until(lambda: (fast_cluster.worker_status("victim") or {}).get("in_flight", 0) > 0, what="the victim to hold requests")
    victim.kill()
    rank.check(tiny_model)
    status = fast_cluster.status()
    assert [w["worker"] for w in status["services"][SERVICE]["workers"]] == ["survivor"]
    assert status["counters"]["workers_expired"] == 1 and status["counters"]["requeued"] >= 1


def test_late_reply_from_a_worker_declared_dead_is_dropped(fast_cluster, tiny_target, tiny_model):
    frozen = fast_cluster.add_worker(tiny_target, *SLOW, "--name", "frozen", env={"FAKE_FORWARD_S": "1.0"})
    fast_cluster.add_worker(tiny_target, *SLOW, "--name", "other", env={"FAKE_FORWARD_S": "0.1"})
    rank = RankRun(fast_cluster.frontend, batches(8, seed=1), depth=4, keep_open=True)
    rank.start()
    wait_until(lambda: (fast_cluster.worker_status("frozen") or {}).get("in_flight", 0) > 0, what="a request at the frozen worker")
    frozen.signal(signal.SIGSTOP)  # mid-forward: its answer will come late
    try:
        wait_until(lambda: fast_cluster.worker_status("frozen") is None, what="the broker to declare the frozen worker dead")
        wait_until(lambda: rank.finished.is_set(), timeout_s=120, what="the rank to be served by the other worker")
    finally:
        frozen.signal(signal.SIGCONT)
    assert rank.target is not None
    wait_until(lambda: rank.target.connection_stats.duplicates_dropped >= 1, what="the late reply to arrive and be dropped")
    wait_until(lambda: fast_cluster.worker_status("frozen") is not None, what="the thawed worker to register again")
    rank.check(tiny_model)


def test_no_worker_then_one_joins_and_the_run_completes(fast_cluster, tiny_target, tiny_model):
    only = fast_cluster.add_worker(tiny_target, *SLOW, "--name", "first")
    rank = RankRun(fast_cluster.frontend, batches(10, seed=2), depth=2, wait_log_interval=0.5)
    rank.start()
    wait_until(lambda: len(rank.results) >= 2, what="some progress")
    only.kill()
    wait_until(lambda: fast_cluster.worker_status("first") is None, what="the broker to notice the dead worker")
    done_before = len(rank.results)
    fast_cluster.add_worker(tiny_target, *SLOW, "--name", "second")
    rank.check(tiny_model)
    assert done_before < len(rank.batches)


def test_a_worker_that_joins_gets_work_at_registration(fast_cluster, tiny_target, tiny_model):
    fast_cluster.add_worker(tiny_target, *SLOW, "--name", "w1", "--capacity", "1")
    rank = RankRun(fast_cluster.frontend, batches(60, seed=3), depth=4)  # 18 s of work for w1 alone
    rank.start()
    wait_until(lambda: fast_cluster.status()["services"][SERVICE]["queued"] > 0, what="a queue to form")
    fast_cluster.add_worker(tiny_target, *SLOW, "--name", "w2", "--capacity", "1")
    joined = fast_cluster.worker_status("w2")  # asked right after its ready line, which follows its registration
    assert not rank.finished.is_set(), "the run ended before the second worker joined; make it longer"
    assert joined is not None and joined["in_flight"] + joined["served"] > 0, "the queue was not dispatched to the new worker"
    rank.check(tiny_model)


def test_worker_sigterm_drains_hands_back_and_exits_zero(fast_cluster, tiny_target, tiny_model):
    leaving = fast_cluster.add_worker(tiny_target, *SLOW, "--name", "leaving", "--capacity", "3")
    rank = RankRun(fast_cluster.frontend, batches(12, seed=6), depth=4)
    rank.start()
    wait_until(lambda: (fast_cluster.worker_status("leaving") or {}).get("in_flight", 0) >= 2, what="requests queued at the worker")
    fast_cluster.add_worker(tiny_target, *SLOW, "--name", "staying")
    assert leaving.stop(timeout_s=30) == 0
    rank.check(tiny_model)
    assert fast_cluster.worker_status("leaving") is None


def test_engine_out_of_memory_is_retried_elsewhere_and_a_crash_is_reported(fast_cluster, tiny_target, tiny_model):
    fast_cluster.add_worker(tiny_target, "--engine", "fake_engines:FakeFlakyEngine", "--service", SERVICE, "--name", "flaky")
    with RemoteEagle3Target(fast_cluster.frontend, SERVICE) as target:
        crash = make_batch(1, 6, 1000, seed=0)
        crash["input_ids"][0, 0] = CRASH_MARKER
        with pytest.raises(RemoteTargetError, match="ValueError in the fake-flaky engine: fake: the engine crashed on this batch"):
            target.generate_batch(**crash)
        oom = make_batch(1, 6, 1000, seed=1)
        oom["input_ids"][0, 0] = OOM_MARKER
        future = target.generate_batch_async(**oom)
        # Counted broker-wide: a worker the loaded machine kept silent past the liveness period registers again with
        # fresh counts of its own (seen on CI), while the broker's requeues keep counting.
        wait_until(lambda: fast_cluster.status()["requeues"].get("retry") == 1, what="the flaky worker to hand the batch back")
        assert not future.done()  # waiting for a worker that has not failed it
        fast_cluster.add_worker(tiny_target, "--service", SERVICE, "--name", "sound")
        assert_supervision_equal(future.result(timeout=60), reference_eagle3(tiny_model, oom, [1, 3, 4]))
        good = make_batch(2, 6, 1000, seed=2)
        good["input_ids"][0, 0] = 11
        assert_supervision_equal(target.generate_batch(**good), reference_eagle3(tiny_model, good, [1, 3, 4]))
    assert fast_cluster.status()["requeues"].get("retry") == 1  # the OOM batch only, and once
    # A worker's done can reach the broker after its result reached the rank.
    wait_until(lambda: fast_cluster.worker_status("sound")["served"] >= 1, what="the broker to count the batch the sound worker served")


def test_a_rank_that_leaves_while_its_batch_is_computed_costs_the_next_rank_nothing(fast_cluster, tiny_target, tiny_model):
    """The broker's forget_rank reaches the worker while it computes the leaving rank's batch: the worker drops that
    answer at once, rather than waiting --send-timeout for a rank that is gone, and serves the next rank's batch."""
    fast_cluster.add_worker(tiny_target, *SLOW, "--name", "patient", "--send-timeout", "600", env={"FAKE_FORWARD_S": "1.0"})
    leaving = RemoteEagle3Target(fast_cluster.frontend, SERVICE, prefetch_depth=1)
    leaving.get_input_embeddings()  # the worker has reached its data socket: a send to it now waits, it does not fail fast
    leaving.generate_batch_async(**make_batch(2, 16, 1000, seed=70))
    wait_until(lambda: (fast_cluster.worker_status("patient") or {}).get("in_flight", 0) > 0, what="the leaving rank's batch at the worker")
    leaving.close()  # mid-forward
    batch = make_batch(2, 16, 1000, seed=71)
    with RemoteEagle3Target(fast_cluster.frontend, SERVICE, prefetch_depth=1, request_timeout=30) as staying:
        supervision = staying.generate_batch(**batch)  # a stuck delivery would hold it for 600 s: RemoteTargetTimeout
    assert_supervision_equal(supervision, reference_eagle3(tiny_model, batch, [1, 3, 4]))
