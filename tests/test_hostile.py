"""10,000 malformed and forged messages from another process while a real training loop runs beside them."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import Cluster, assert_supervision_equal, make_batch, reference_eagle3

from draftfeed import RemoteEagle3Target

pytestmark = pytest.mark.timeout(300)
SERVICE = "svc"
MESSAGES = 10_000


def test_hostile_peer_changes_nothing_for_a_running_rank(tiny_target, tiny_model):
    cluster = Cluster()
    try:
        workers = [cluster.add_worker(tiny_target, "--service", SERVICE, "--name", f"w{i}") for i in range(2)]
        batches = [make_batch(2, 16, 1000, seed=i) for i in range(60)]
        results: list = []
        with RemoteEagle3Target(cluster.frontend, SERVICE, prefetch_depth=2) as target:
            hostile_started = threading.Event()

            def train() -> None:
                for batch, supervision in target.iterate(batches):
                    results.append((batch, supervision))
                    hostile_started.wait(60)  # the flood runs during the training loop

            rank_id = target.rank_id
            (window,) = [c["window"] for c in target.status()["ranks"] if c["rank"] == rank_id]  # before the flood
            training = threading.Thread(target=train, daemon=True)
            training.start()
            hostile = subprocess.Popen(
                [
                    sys.executable,
                    str(Path(__file__).with_name("hostile_peer.py")),
                    cluster.frontend,
                    cluster.backend,
                    target.data_endpoint,
                    target.rank_id,
                    str(MESSAGES),
                    "7",
                ],
                stdout=subprocess.PIPE,
                text=True,
            )
            hostile_started.set()
            # The broker's ranks as status lists them while the flood runs: the hostile ones are forgotten once they
            # fall silent (the peer waits for that before it exits), so only now are they there to look at.
            listed: list[dict] = []
            try:
                deadline = time.monotonic() + 240
                while hostile.poll() is None and time.monotonic() < deadline:
                    listed += target.status()["ranks"]
                    time.sleep(0.2)
                out, _ = hostile.communicate(timeout=10)
            finally:
                if hostile.poll() is None:
                    hostile.kill()
            training.join(120)
            assert not training.is_alive()
            stats = target.connection_stats
            status = target.status()
        report = json.loads(out.strip().splitlines()[-1])
        assert report["sent"]["broker"] + report["sent"]["data"] == MESSAGES
        assert cluster.broker.popen.poll() is None and all(w.popen.poll() is None for w in workers), "a process died"
        assert report["replies"] >= 0.9 * report["sent"]["broker"], report
        assert status["counters"]["rejected_messages"] >= 0.5 * report["sent"]["broker"]
        assert stats.foreign_dropped + stats.duplicates_dropped + stats.malformed_dropped == report["sent"]["data"]
        # The forged hellos (another rank's name, window 64) changed no record: hostile-0 was listed, always with the
        # window of its own hellos, and the training rank always with its own.
        assert {c["window"] for c in listed if c["rank"] == "hostile-0"} == {2}, listed
        assert {c["window"] for c in listed if c["rank"] == rank_id} == {window}, listed
        assert len(results) == len(batches)
        for (got, supervision), batch in zip(results, batches):
            assert got is batch
            assert_supervision_equal(supervision, reference_eagle3(tiny_model, batch, [1, 3, 4]))
    finally:
        cluster.stop()
