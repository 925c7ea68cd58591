"""A real broker with a few thousand simulated peers speaking the protocol (draftfeed/bench/cluster/): every
peer heartbeats and none is expired, every request is dispatched once and each rank's in order, ``draftfeed
status`` answers with every worker and rank (over several pages), and the broker holds nothing once they leave.
Speed is the bench's (``draftfeed bench --scenario cluster``), never asserted here."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import wait_until

from draftfeed.bench.cluster import Load, SimulatedCluster
from draftfeed.observe.status_client import fetch_status
from draftfeed.processes import commands

pytestmark = pytest.mark.timeout(240)

LOAD = Load(ranks=2_000, workers=48, compute_ms=100.0, prefetch=1, capacity=2, warmup_s=1.0, measure_s=6.0)


@pytest.fixture
def broker():
    # A long liveness period: the suite's other tests share the cores, and a peer starved of them for a few seconds
    # is not what this test is about (the expiry of silent peers is tests/test_reliability_broker.py's).
    broker = commands.start_broker(extra=["--log-level", "WARNING", "--liveness", "30"])
    try:
        yield broker
    finally:
        broker.stop()


def test_a_broker_with_two_thousand_ranks_serves_each_request_once_in_order(broker):
    cluster = SimulatedCluster(broker.ready["frontend"], broker.ready["backend"], LOAD)
    try:
        cluster.start()
        run = cluster.run(on_tick=None)
        status = fetch_status(broker.ready["frontend"], timeout_s=30)
        text = subprocess.run(
            [sys.executable, "-m", "draftfeed", "status", "--broker", broker.ready["frontend"]], capture_output=True, text=True, timeout=60
        )
        cluster.leave()
        report = run.report()
        assert report["errors"] == {}, f"peers heard errors (a forgotten peer was expired as silent): {report['errors']}"
        assert report["duplicates"] == 0 and report["out_of_order"] == 0, report
        assert report["answered"] > LOAD.workers, report  # every worker served, many times
        assert report["dispatched"] >= report["answered"] and report["submitted"] - report["dispatched"] <= LOAD.ranks * LOAD.prefetch
        assert status["counters"]["ranks_expired"] == 0 and status["counters"]["workers_expired"] == 0, status["counters"]
        assert status["rank_count"] == LOAD.ranks and len(status["ranks"]) == LOAD.ranks
        assert len({rank["rank"] for rank in status["ranks"]}) == LOAD.ranks
        assert [len(s["workers"]) for s in status["services"].values()] == [LOAD.workers]
        assert text.returncode == 0 and f"{LOAD.workers} workers, {LOAD.ranks} ranks" in text.stdout
        assert "--list shows each of them" in text.stdout and "rank sim-r1 " not in text.stdout  # a summary at this size

        def empty() -> bool:
            summary = fetch_status(broker.ready["frontend"], summary=True)
            return summary["rank_count"] == 0 and summary["worker_count"] == 0

        wait_until(empty, timeout_s=30, what="the broker to hold no peer after every bye")
    finally:
        cluster.close()
