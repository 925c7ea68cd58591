"""Processes stop as schedulers expect (issue 15): a worker with nothing in hand leaves at once, also when no broker
answers; a second SIGTERM exits immediately; and a waiting rank says what it waits for and why. The demo's children
at every moment of its life: tests/test_stopping_moments.py."""

from __future__ import annotations

import logging
import re
import signal

import pytest
from conftest import FAST_LIVENESS, WORKER_ENV, Cluster, make_batch, wait_until
from support.lines import wait_for_line

from draftfeed import RemoteEagle3Target
from draftfeed.processes import commands

pytestmark = pytest.mark.timeout(180)
SLOW = ["--engine", "fake_engines:FakeSlowEngine", "--service", "svc"]


def test_a_worker_that_no_broker_answers_leaves_at_once_on_sigterm(tiny_target):
    worker = commands.start(
        ["worker", "--broker", "tcp://127.0.0.1:9", "--target", str(tiny_target), "--register-timeout", "600"],
        env=WORKER_ENV,
        ready_timeout_s=60,
        ready_pattern=r"registering with the broker at tcp://127.0.0.1:9",
    )
    try:
        worker.signal(signal.SIGTERM)
        assert worker.popen.wait(15) == 0
        assert any("stopped before a broker answered" in line for line in worker.log_tail)
    finally:
        worker.kill()


def test_a_worker_whose_broker_died_leaves_at_once_and_a_second_sigterm_ends_a_long_forward(tiny_target):
    cluster = Cluster(*FAST_LIVENESS)
    try:
        idle = cluster.add_worker(tiny_target, *SLOW, "--name", "idle")
        busy = cluster.add_worker(tiny_target, *SLOW, "--name", "busy", env={"FAKE_FORWARD_S": "120"})
        with RemoteEagle3Target(cluster.frontend, "svc") as target:
            target.model_info()
            target.generate_batch_async(**make_batch(1, 4, 1000, seed=1))
            target.generate_batch_async(**make_batch(1, 4, 1000, seed=2))
            wait_until(lambda: all((cluster.worker_status(n) or {}).get("in_flight") for n in ("idle", "busy")), what="both workers busy")
        wait_until(lambda: (cluster.worker_status("idle") or {}).get("in_flight") == 0, timeout_s=60, what="the idle worker done with its batch")
        cluster.broker.kill()
        idle.signal(signal.SIGTERM)
        assert idle.popen.wait(15) == 0  # nothing in hand: it leaves at once, with no broker to answer
        busy.signal(signal.SIGTERM)  # in the middle of a 120 s forward: it cannot stop yet
        wait_for_line(busy, r"SIGTERM: stopping \(another one exits at once\)", timeout_s=10)
        busy.signal(signal.SIGTERM)
        assert busy.popen.wait(15) == 128 + signal.SIGTERM
        wait_for_line(busy, "SIGTERM again: exiting now", timeout_s=5)
    finally:
        cluster.stop()


def test_a_waiting_rank_says_how_long_and_why(tiny_target, caplog):
    cluster = Cluster(*FAST_LIVENESS)
    try:
        cluster.add_worker(tiny_target, *SLOW, "--name", "slow", env={"FAKE_FORWARD_S": "2.5"})
        with caplog.at_level(logging.WARNING, logger="draftfeed.producer"):
            with RemoteEagle3Target(cluster.frontend, "svc", wait_log_interval=0.5) as target:
                target.generate_batch(**make_batch(1, 4, 1000, seed=3))
        waits = [r.getMessage() for r in caplog.records if r.getMessage().startswith("draftfeed: waiting")]
        assert waits, "no wait was logged"
        assert re.match(
            r"draftfeed: waiting [1-9]\d* s for supervision from service 'svc' \(1 batches in flight\): its 1 workers have not answered \(the broker was heard \d+\.\d s ago\)",
            waits[-1],
        ), waits[-1]
    finally:
        cluster.stop()
