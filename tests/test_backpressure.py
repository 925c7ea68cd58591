"""Memory and queues stay bounded: slow training loops, slow workers, a full service queue, an unreachable rank."""

from __future__ import annotations

import threading

import pytest
import torch
from conftest import FAST_LIVENESS, Cluster, assert_supervision_equal, make_batch, raw_peer, reference_eagle3, wait_until

from draftfeed import RemoteEagle3Target
from draftfeed.dataplane.frames.codec import pack_tensors
from draftfeed.schemas.frames import pack, unpack
from draftfeed.schemas.messages import FRONTEND_OUTBOUND, ErrorReply, Heartbeat, Hello, Submit, Welcome

pytestmark = pytest.mark.timeout(300)
SERVICE = "svc"


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def test_slow_training_loop_keeps_memory_and_queues_flat(tiny_target):
    cluster = Cluster(*FAST_LIVENESS)
    try:
        workers = [cluster.add_worker(tiny_target, "--service", SERVICE, "--name", f"w{i}") for i in range(2)]
        pids = {"broker": cluster.broker.pid, **{f"w{i}": w.pid for i, w in enumerate(workers)}}
        depth, steps = 3, 300
        samples: list[dict] = []

        def batches():
            for i in range(steps):
                yield make_batch(4, 64, 1000, seed=i, ragged=False)

        with RemoteEagle3Target(cluster.frontend, SERVICE, prefetch_depth=depth) as target:
            for step, (_batch, supervision) in enumerate(target.iterate(batches())):
                torch.linalg.qr(torch.randn(160, 160))  # the training step: slower than the workers
                per_batch_mb = supervision.nbytes / 2**20
                if step % 25 == 0:
                    status = target.status()
                    me = next(c for c in status["ranks"] if c["rank"] == target.rank_id)
                    samples.append(
                        {
                            "step": step,
                            "rss": {name: rss_mb(pid) for name, pid in pids.items()},
                            "queued": status["services"][SERVICE]["queued"],
                            "worker_in_flight": [w["in_flight"] for w in status["services"][SERVICE]["workers"]],
                            "outstanding": me["outstanding"],
                            "parked": me["parked"],
                            "rank_in_flight": target.in_flight,
                        }
                    )
    finally:
        cluster.stop()
    for sample in samples:
        assert sample["queued"] <= depth
        assert all(n <= 2 for n in sample["worker_in_flight"])  # capacity
        # Queued or at a worker, as the broker counts; parked: sent after the result arrived, before the done did.
        assert sample["outstanding"] <= depth and sample["parked"] <= depth and sample["rank_in_flight"] <= depth
    # Flat memory: after warm-up, no process grows by more than a few batches' worth of supervision.
    warm = samples[2]["rss"]
    allowance = 8 * per_batch_mb + 16
    growth = {name: max(s["rss"][name] for s in samples[3:]) - warm[name] for name in warm}
    print(f"rss after warm-up {warm} MB; largest growth {growth} MB; allowance {allowance:.1f} MB")
    for sample in samples[3:]:
        for name, value in sample["rss"].items():
            assert value - warm[name] <= allowance, f"{name} grew {value - warm[name]:.1f} MB by step {sample['step']} (allowed {allowance:.1f})"


def test_a_full_service_queue_pushes_back_on_ranks(tiny_target, tiny_model):
    cluster = Cluster(*FAST_LIVENESS, "--max-queued", "2")
    try:
        cluster.add_worker(
            tiny_target, "--engine", "fake_engines:FakeSlowEngine", "--service", SERVICE, "--capacity", "1", env={"FAKE_FORWARD_S": "0.05"}
        )
        results: dict[int, list] = {}
        errors: list[BaseException] = []
        peak_queue = [0]
        done = threading.Event()

        def rank(index: int) -> None:
            try:
                batches = [make_batch(1, 8, 1000, seed=100 * index + i) for i in range(12)]
                with RemoteEagle3Target(cluster.frontend, SERVICE, prefetch_depth=4) as target:
                    results[index] = [(b, s, target) for b, s in target.iterate(batches)]
                    results[index].append(target.connection_stats.busy_retries)
            except BaseException as exc:
                errors.append(exc)

        def watch() -> None:
            while not done.is_set():
                peak_queue[0] = max(peak_queue[0], cluster.status()["services"].get(SERVICE, {}).get("queued", 0))
                done.wait(0.02)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        ranks = [threading.Thread(target=rank, args=(i,)) for i in range(3)]
        for thread in ranks:
            thread.start()
        for thread in ranks:
            thread.join(200)
        done.set()
        watcher.join(10)
    finally:
        cluster.stop()
    assert not errors, errors
    assert peak_queue[0] <= 2, f"the service queue reached {peak_queue[0]}, over its limit of 2"
    assert sum(results[i][-1] for i in range(3)) > 0, "no rank was ever pushed back"
    for index in range(3):
        for batch, supervision, _target in results[index][:-1]:
            assert_supervision_equal(supervision, reference_eagle3(tiny_model, batch, [1, 3, 4]))
        assert len(results[index]) - 1 == 12


def test_an_unreachable_rank_is_told_so_and_others_are_served(tiny_target, tiny_model):
    # A liveness period (20 s) longer than the rest of the test: the hand-spoken rank heartbeats only while it waits.
    cluster = Cluster("--heartbeat-interval", "0.2", "--liveness", "100")
    try:
        cluster.add_worker(tiny_target, "--service", SERVICE, "--connect-timeout", "1")
        with raw_peer(cluster.frontend, b"lost-rank") as sock:
            sock.send_multipart(pack(Hello(rank="lost-rank", service=SERVICE, data_endpoint="tcp://127.0.0.1:1", window=2, host="h", pid=1)))
            sock.send_multipart(pack_tensors(Submit, make_batch(1, 4, 1000, seed=0), request_id=0, kind="eagle3", token=5), copy=False)
            with RemoteEagle3Target(cluster.frontend, SERVICE) as target:
                batch = make_batch(2, 8, 1000, seed=1)
                assert_supervision_equal(target.generate_batch(**batch), reference_eagle3(tiny_model, batch, [1, 3, 4]))

            def unreachable_reply():
                while sock.poll(100):
                    message, _ = unpack(sock.recv_multipart(), FRONTEND_OUTBOUND)
                    if isinstance(message, ErrorReply) and message.code == "unreachable":
                        return message
                    assert isinstance(message, (Welcome, Heartbeat)), message
                    sock.send_multipart(pack(Heartbeat()))
                return None

            reply = wait_until(unreachable_reply, timeout_s=30, what="the unreachable error")
            assert "cannot reach this rank's data socket tcp://127.0.0.1:1" in reply.message and "data_endpoint=" in reply.message
            assert all(c["rank"] != "lost-rank" for c in cluster.status()["ranks"])
    finally:
        cluster.stop()
