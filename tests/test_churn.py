"""No run dies of a fault that is not its batch's (issue 15): workers killed and replaced in runs, frozen past the
liveness period and thawed, the broker killed and restarted, while three training ranks (processes of their own)
iterate; and a poison batch, which takes down every worker it meets, still fails after --max-attempts with what
each worker said, while the other ranks' batches arrive unharmed."""

from __future__ import annotations

import json
import random
import signal
import threading
import time

import pytest
from conftest import FAST_LIVENESS, WORKER_ENV, Cluster, make_batch
from fake_engines import POISON_MARKER
from rank_run import SERVICE, RankRun, batches
from support.lines import wait_for_line

from draftfeed import RemoteEagle3Target, RemoteTargetError
from draftfeed.processes import commands

pytestmark = pytest.mark.timeout(300)
SLOW = ["--engine", "fake_engines:FakeSlowEngine", "--service", SERVICE]
CRASHING = ["--engine", "fake_engines:FakeCrashingEngine", "--service", SERVICE]
WINDOW_S = 1.0  # FAST_LIVENESS: 0.2 s heartbeats, 5 missed


class Chaos(threading.Thread):
    """Kills workers and starts replacements, freezes them past the liveness period and thaws them, and kills and
    restarts the broker once, at random moments 1 to 2.5 s apart (seeded), until told to stop."""

    def __init__(self, cluster: Cluster, target, seed: int) -> None:
        super().__init__(daemon=True)
        self.cluster, self.target, self.random = cluster, target, random.Random(seed)
        self.stop_now = threading.Event()
        self.done: list[str] = []
        self.error: BaseException | None = None
        self._count = 0
        self.starting: list[threading.Thread] = []  # replacements on their way up: joined before the cluster stops

    def live_workers(self) -> list[commands.Process]:
        return [w for w in self.cluster.workers if w.popen.poll() is None]

    def replace(self) -> None:
        self._count += 1
        name = f"spare-{self._count}"
        starting = threading.Thread(
            target=lambda: self.cluster.add_worker(self.target, *SLOW, "--name", name, env={"FAKE_FORWARD_S": "0.03"}), daemon=True
        )
        self.starting.append(starting)
        starting.start()

    def run(self) -> None:
        try:
            step = 0
            while not self.stop_now.wait(self.random.uniform(1.0, 2.5)):
                step += 1
                workers = self.live_workers()
                action = "broker" if step == 3 else self.random.choice(["kill", "kill", "freeze"])
                if action == "broker":
                    self.cluster.broker.kill()
                    self.cluster.restart_broker()
                elif workers and action == "kill":
                    self.random.choice(workers).kill()
                    self.replace()
                elif workers:
                    victim = self.random.choice(workers)
                    victim.signal(signal.SIGSTOP)
                    self.stop_now.wait(1.5 * WINDOW_S)
                    victim.signal(signal.SIGCONT)
                self.done.append(action)
        except BaseException as exc:  # reported by the test
            self.error = exc


def test_three_ranks_get_every_batch_through_worker_churn_and_a_broker_restart(tiny_target):
    cluster = Cluster(*FAST_LIVENESS)
    ranks: list[commands.Process] = []
    chaos = Chaos(cluster, tiny_target, seed=15)
    try:
        for index in range(3):
            cluster.add_worker(tiny_target, *SLOW, "--name", f"w{index}", env={"FAKE_FORWARD_S": "0.03"})
        for index in range(3):
            ranks.append(
                commands.start(
                    [
                        "--broker",
                        cluster.frontend,
                        "--service",
                        SERVICE,
                        "--target",
                        str(tiny_target),
                        "--batches",
                        "150",
                        "--draft-vocab",
                        "300",
                        "--seed",
                        str(7000 + 1000 * index),
                    ],
                    module="rank_process",
                    env=WORKER_ENV,
                )
            )
        chaos.start()
        results = [json.loads(wait_for_line(rank, "^RESULT ", timeout_s=240)[len("RESULT ") :]) for rank in ranks]
    finally:
        chaos.stop_now.set()
        chaos.join(30)
        for starting in chaos.starting:
            starting.join(60)  # a replacement not yet in cluster.workers would outlive the test otherwise
        for rank in ranks:
            rank.stop(timeout_s=5)
        cluster.stop()
    assert chaos.error is None, chaos.error
    assert "broker" in chaos.done and chaos.done.count("kill") >= 2, f"the schedule did too little: {chaos.done}"
    for result in results:
        assert result["error"] is None, result["error"]
        assert result["differences"] == [], "\n".join(result["differences"])
        assert result["received"] == result["sent"] and result["in_order"]


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
