"""Broker and rank faults with real processes: the broker killed or stopped and restarted, no worker for a service, a
rank killed.

The promise under test: every rank receives the supervision of every batch it sent exactly once, in
its order, equal to the in-process computation, as long as some worker eventually serves its service.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from conftest import WORKER_ENV, make_batch, wait_until
from rank_run import SERVICE, SLOW, RankRun, batches

from draftfeed import RemoteEagle3Target, RemoteTargetError

pytestmark = pytest.mark.timeout(240)


def test_a_service_whose_workers_all_left_times_out_saying_so(fast_cluster, tiny_target):
    only = fast_cluster.add_worker(tiny_target, *SLOW, "--name", "only")
    with RemoteEagle3Target(fast_cluster.frontend, SERVICE, request_timeout=1.5, wait_log_interval=0.5) as target:
        target.model_info()
        only.kill()
        wait_until(lambda: fast_cluster.worker_status("only") is None, what="the broker to notice the dead worker")
        with pytest.raises(RemoteTargetError, match=f"service '{SERVICE}' within 2 s .*: no worker serves the service now"):
            target.generate_batch(**make_batch(1, 4, 1000, seed=0))


def test_a_broker_that_shut_down_is_named_as_the_cause(fast_cluster, tiny_target):
    fast_cluster.add_worker(tiny_target, *SLOW, "--name", "w1")
    with RemoteEagle3Target(fast_cluster.frontend, SERVICE, request_timeout=2.0, wait_log_interval=0.5) as target:
        target.model_info()
        assert fast_cluster.broker.stop(timeout_s=30) == 0  # SIGTERM: it says goodbye; no broker follows
        with pytest.raises(RemoteTargetError, match=r"the broker at tcp://127\.0\.0\.1:\d+ shut down \d+ s ago and no broker has answered since"):
            target.generate_batch(**make_batch(1, 4, 1000, seed=0))


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
        wait_until(
            lambda: sum(w["mappings"] for w in fast_cluster.status()["services"][SERVICE]["workers"]) >= 1, what="a worker to hold its mapping"
        )
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
