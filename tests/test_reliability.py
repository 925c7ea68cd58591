"""Faults with real processes: workers and brokers killed (SIGKILL), frozen, stopped, restarted; ranks killed.

The promise under test: every rank receives the supervision of every batch it sent exactly once, in
its order, equal to the in-process computation, as long as some worker eventually serves its service.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import threading

import pytest

from conftest import WORKER_ENV, assert_supervision_equal, make_batch, reference_eagle3, wait_until
from draftfeed import RemoteEagle3Target, RemoteTargetError
from fake_engines import CRASH_MARKER, OOM_MARKER

pytestmark = pytest.mark.timeout(240)
SERVICE = "svc"
SLOW = ["--engine", "fake_engines:FakeSlowEngine", "--service", SERVICE]


class RankRun(threading.Thread):
    """A training rank iterating in the background; ``results`` fills as it goes."""

    def __init__(self, frontend: str, batches: list[dict], depth: int = 2, keep_open: bool = False, **kwargs) -> None:
        super().__init__(daemon=True)
        self.frontend, self.batches, self.depth, self.kwargs = frontend, batches, depth, kwargs
        self.results: list[tuple[dict, object]] = []
        self.error: BaseException | None = None
        self.target: RemoteEagle3Target | None = None
        self.finished = threading.Event()
        self.release = threading.Event()
        if not keep_open:
            self.release.set()

    def run(self) -> None:
        try:
            with RemoteEagle3Target(self.frontend, SERVICE, prefetch_depth=self.depth, **self.kwargs) as target:
                self.target = target
                for batch, supervision in target.iterate(self.batches):
                    self.results.append((batch, supervision))
                self.finished.set()
                self.release.wait(120)
        except BaseException as exc:
            self.error = exc
        finally:
            self.finished.set()

    def check(self, model, timeout_s: float = 150.0) -> None:
        """Every batch once, in order, bit-exact."""
        self.release.set()
        self.join(timeout_s)
        assert not self.is_alive(), "the rank did not finish"
        if self.error is not None:
            raise self.error
        assert len(self.results) == len(self.batches)
        for (got_batch, supervision), batch in zip(self.results, self.batches):
            assert got_batch is batch, "out of order"
            assert_supervision_equal(supervision, reference_eagle3(model, batch, [1, 3, 4]))


def batches(count: int, seed: int = 0) -> list[dict]:
    return [make_batch(2, 16, 1000, seed=seed * 1000 + i) for i in range(count)]


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


def test_no_worker_for_longer_than_the_timeout_is_an_error_naming_the_service(fast_cluster, tiny_target):
    with RemoteEagle3Target(fast_cluster.frontend, "orphaned", request_timeout=1.5, wait_log_interval=0.5) as target:
        with pytest.raises(RemoteTargetError, match="service 'orphaned'"):
            target.generate_batch(**make_batch(1, 4, 1000, seed=0))


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


def test_broker_killed_and_restarted_on_the_same_address(fast_cluster, tiny_target, tiny_model):
    fast_cluster.add_worker(tiny_target, *SLOW, "--name", "w1")
    fast_cluster.add_worker(tiny_target, *SLOW, "--name", "w2")
    rank = RankRun(fast_cluster.frontend, batches(14, seed=4), depth=3)
    rank.start()
    wait_until(lambda: len(rank.results) >= 3, what="some progress")
    fast_cluster.broker.kill()
    fast_cluster.restart_broker()
    rank.check(tiny_model)
    assert rank.target is not None and rank.target.connection_stats.resyncs >= 1
    status = fast_cluster.status()
    assert sorted(w["worker"] for w in status["services"][SERVICE]["workers"]) == ["w1", "w2"]


def test_broker_sigterm_drains_and_exits_zero_then_a_new_one_takes_over(fast_cluster, tiny_target, tiny_model):
    fast_cluster.add_worker(tiny_target, *SLOW, "--name", "w1")
    rank = RankRun(fast_cluster.frontend, batches(10, seed=5), depth=2)
    rank.start()
    wait_until(lambda: len(rank.results) >= 2, what="some progress")
    assert fast_cluster.broker.stop(timeout_s=30) == 0
    fast_cluster.restart_broker()
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
        wait_until(lambda: fast_cluster.worker_status("flaky")["handed_back"] == 1, what="the flaky worker to hand the batch back")
        assert not future.done()  # waiting for a worker that has not failed it
        fast_cluster.add_worker(tiny_target, "--service", SERVICE, "--name", "sound")
        assert_supervision_equal(future.result(timeout=60), reference_eagle3(tiny_model, oom, [1, 3, 4]))
        good = make_batch(2, 6, 1000, seed=2)
        good["input_ids"][0, 0] = 11
        assert_supervision_equal(target.generate_batch(**good), reference_eagle3(tiny_model, good, [1, 3, 4]))
    assert fast_cluster.worker_status("flaky")["handed_back"] == 1
    assert fast_cluster.worker_status("sound")["served"] >= 1


RANK_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    from draftfeed import RemoteEagle3Target
    target = RemoteEagle3Target(sys.argv[1], "svc", prefetch_depth=3)
    ids = torch.arange(0, 1000, 10)
    mask = torch.zeros(1000, dtype=torch.bool)
    mask[ids] = True
    target.set_vocab_mapping(ids, mask)
    print(target.rank_id, flush=True)
    def forever():
        i = 0
        while True:
            i += 1
            g = torch.Generator().manual_seed(i)
            ids = torch.randint(0, 1000, (2, 16), generator=g)
            yield {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}
    for _ in target.iterate(forever()):
        pass
    """
)


def test_killed_rank_is_forgotten_and_others_are_not_slowed(fast_cluster, tiny_target, tiny_model):
    fast_cluster.add_worker(tiny_target, *SLOW, "--name", "w1", env={"FAKE_FORWARD_S": "0.05"})
    fast_cluster.add_worker(tiny_target, *SLOW, "--name", "w2", env={"FAKE_FORWARD_S": "0.05"})
    doomed = subprocess.Popen([sys.executable, "-c", RANK_SCRIPT, fast_cluster.frontend], stdout=subprocess.PIPE, text=True, env={**WORKER_ENV})
    try:
        doomed_id = doomed.stdout.readline().strip()
        assert doomed_id, "the doomed rank did not start"

        def doomed_status():
            return next((c for c in fast_cluster.status()["ranks"] if c["rank"] == doomed_id), None)

        wait_until(lambda: (doomed_status() or {}).get("completed", 0) >= 3, what="the doomed rank to be served")
        wait_until(lambda: sum(w["mappings"] for w in fast_cluster.status()["services"][SERVICE]["workers"]) >= 1, what="a worker to hold its mapping")
        doomed.kill()
        doomed.wait(10)
        wait_until(lambda: doomed_status() is None, what="the broker to forget the killed rank")
        status = fast_cluster.status()
        assert status["counters"]["ranks_expired"] == 1
        wait_until(
            lambda: all(w["rank_links"] == 0 and w["mappings"] == 0 for w in fast_cluster.status()["services"][SERVICE]["workers"]),
            what="the workers to drop their link and mapping for the killed rank",
        )
        rank = RankRun(fast_cluster.frontend, batches(10, seed=7), depth=2)
        rank.start()
        rank.check(tiny_model)
    finally:
        if doomed.poll() is None:
            doomed.kill()
            doomed.wait(10)
