"""No run dies of a fault that is not its batch's (issue 15): a poison batch, which takes down every worker it meets,
still fails after --max-attempts with what each worker said, while the other ranks' batches arrive unharmed. Workers
killed, frozen and replaced and the broker restarted while three ranks iterate: tests/test_soak.py, many seeded
schedules of them."""

from __future__ import annotations

import threading
import time

import pytest
from conftest import FAST_LIVENESS, Cluster, make_batch
from fake_engines import POISON_MARKER
from rank_run import SERVICE, RankRun, batches

from draftfeed import RemoteEagle3Target, RemoteTargetError

pytestmark = pytest.mark.timeout(300)
CRASHING = ["--engine", "fake_engines:FakeCrashingEngine", "--service", SERVICE]


def test_a_poison_batch_fails_after_max_attempts_and_other_ranks_are_unharmed(tiny_target, tiny_model):
    cluster = Cluster(*FAST_LIVENESS, "--max-attempts", "3")
    stop = threading.Event()

    def keep_two_workers() -> None:
        spares = 0
        while not stop.wait(0.2):
            if sum(1 for w in cluster.workers if w.popen.poll() is None) < 2:
                spares += 1
                cluster.add_worker(tiny_target, *CRASHING, "--name", f"spare-{spares}", env={"FAKE_FORWARD_S": "0.03"})

    supervisor = threading.Thread(target=keep_two_workers, daemon=True)
    try:
        for index in range(2):
            cluster.add_worker(tiny_target, *CRASHING, "--name", f"w{index}", env={"FAKE_FORWARD_S": "0.03"})
        supervisor.start()
        healthy = RankRun(cluster.frontend, batches(40, seed=9), depth=2)
        healthy.start()
        poison = make_batch(1, 6, 1000, seed=3)
        poison["input_ids"][0, 0] = POISON_MARKER
        with RemoteEagle3Target(cluster.frontend, SERVICE, request_timeout=200) as target:
            started = time.monotonic()
            with pytest.raises(RemoteTargetError) as raised:
                target.generate_batch(**poison)
        message = str(raised.value)
        assert "failed on 3 workers of service 'svc' (--max-attempts 3)" in message, message
        assert message.count("died with it in its engine") == 3, message
        assert "input_ids [1, 6]" in message and f"of rank {target.rank_id}" in message, message
        healthy.check(tiny_model)
        requeues = cluster.status()["requeues"]
        assert requeues.get("died_in_engine", 0) >= 2, requeues
        print(f"poison batch failed after {time.monotonic() - started:.1f} s; requeues by cause: {requeues}")
    finally:
        stop.set()
        if supervisor.is_alive():
            supervisor.join(60)  # a spare still starting must register before the broker goes, or it outlives the test
        cluster.stop()
