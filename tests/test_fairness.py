"""Fair sharing of a service across ranks: the round-robin policy, its bound, and the per-rank cap."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import pytest
from conftest import Cluster, make_batch, wait_until
from support.messages import INFO, dispatches, errors

from draftfeed import RemoteEagle3Target, RemoteTargetError
from draftfeed.broker.fair_queue import FairQueue
from draftfeed.broker.settings import BrokerSettings
from draftfeed.broker.state import BrokerState
from draftfeed.schemas.messages import Done, Hello, Register, Submit

pytestmark = pytest.mark.timeout(240)
SERVICE = "svc"


@dataclass
class Item:
    rank_key: str
    n: int


def test_fair_queue_serves_ranks_in_turn_and_requeues_at_the_front():
    queue: FairQueue[Item] = FairQueue()
    for n in range(4):
        queue.append(Item("a", n))
    queue.append(Item("b", 0))
    queue.append(Item("c", 0))
    order = [queue.pop() for _ in range(3)]
    assert [(i.rank_key, i.n) for i in order] == [("a", 0), ("b", 0), ("c", 0)]
    queue.push_front([Item("b", 0)])  # b's request came back: b goes next, before a
    assert (queue.pop().rank_key, len(queue)) == ("b", 3)
    assert [queue.pop().n for _ in range(3)] == [1, 2, 3]
    with pytest.raises(IndexError):
        queue.pop()
    queue.append(Item("x", 0))
    assert queue.drop_rank("x") == [Item("x", 0)] and not queue


def test_a_flooding_rank_cannot_starve_another():
    """One worker of capacity 1; rank A queues 40 requests, then rank B sends 5. Stated bound: with two ranks
    queued, B's next request goes out after at most one of A's."""
    state = BrokerState("test", BrokerSettings(max_queued_per_service=1000))
    state.on_register(b"w", Register(worker="w", service=SERVICE, task="eagle3", engine="hf", info=INFO, capacity=1, host="h", pid=1))
    sent = []
    for name, window in (("A", 64), ("B", 8)):
        state.on_hello(name.encode(), Hello(rank=name, service=SERVICE, data_endpoint=f"tcp://127.0.0.1:1/{name}", window=window, host="h", pid=1))
    for n in range(40):
        sent += dispatches(state.on_submit(b"A", Submit(request_id=n, kind="eagle3"), []))
    for n in range(5):
        sent += dispatches(state.on_submit(b"B", Submit(request_id=n, kind="eagle3"), []))
    while len(sent) < 45:
        _, last = sent[-1]
        sent += dispatches(state.on_done(b"w", Done(ticket=last.ticket, outcome="served")))
    order = [d.rank for _, d in sent]
    assert order[:12] == ["A", "A", "B", "A", "B", "A", "B", "A", "B", "A", "B", "A"]
    assert order[12:] == ["A"] * 33
    assert [d.request.request_id for _, d in sent if d.rank == "B"] == list(range(5)), "each rank's own requests stay in order"


def test_a_window_over_the_per_rank_cap_is_refused_with_the_flag_to_change():
    state = BrokerState("test", BrokerSettings(max_queued_per_rank=16))
    out = state.on_hello(b"r", Hello(rank="r", service=SERVICE, data_endpoint="tcp://127.0.0.1:1", window=17, host="h", pid=1))
    [error] = errors(out)
    assert error.code == "over_limit" and "cap of 16 requests per rank (--max-queued-per-rank)" in error.message
    assert "use prefetch_depth 16 or less" in error.message
    assert not state.ranks


def test_the_cap_stops_a_real_rank_at_connect():
    cluster = Cluster("--max-queued-per-rank", "4")
    try:
        with pytest.raises(RemoteTargetError, match="over this broker's cap of 4"):
            RemoteEagle3Target(cluster.frontend, SERVICE, prefetch_depth=5, connect_timeout=30)
    finally:
        cluster.stop()


def flooder_completed(cluster: Cluster, flooder: RemoteEagle3Target) -> int:
    """The flooder's requests the broker has seen served."""
    [record] = [r for r in cluster.status()["ranks"] if r["rank"] == flooder.rank_id]
    return record["completed"]


# A forward's pace, long beside a status round trip on a loaded machine (about 0.1 s): the flooder's completions are
# read from the broker's status before and after the light rank's batches, and at 0.05 s a forward a slow reply at each
# end counted two more flooder batches than were served around the light rank's (seen on CI: 15 of at most 14).
FORWARD_S = "0.2"


def test_a_light_rank_keeps_its_share_beside_a_flooding_one(tiny_target):
    """Real processes: a worker of capacity 1 at a big target's pace, a rank keeping 32 batches queued, and a
    rank asking one batch at a time. First-come-first-served would put each of the light rank's batches behind
    the flooder's 32; round-robin lets at most one flooder batch go ahead of it, plus the one being computed."""
    cluster = Cluster()
    try:
        cluster.add_worker(
            tiny_target, "--engine", "fake_engines:FakeSlowEngine", "--service", SERVICE, "--capacity", "1", env={"FAKE_FORWARD_S": FORWARD_S}
        )
        flooder = RemoteEagle3Target(cluster.frontend, SERVICE, prefetch_depth=32)
        light = RemoteEagle3Target(cluster.frontend, SERVICE, prefetch_depth=1)
        vocab = flooder.model_info().vocab_size
        done = [0]
        stop = threading.Event()

        def flood() -> None:
            batches = (make_batch(1, 8, vocab, seed=n) for n in range(10_000))
            for _ in flooder.iterate(batches):
                done[0] += 1
                if stop.is_set():
                    return

        thread = threading.Thread(target=flood)
        thread.start()
        try:
            # The light rank's first batch sets up its link to the worker (its data plane among it), once per pair.
            light.generate_batch(**make_batch(1, 8, vocab, seed=49_999))
            wait_until(lambda: flooder.in_flight >= 32 or not thread.is_alive(), what="the flooder's 32 batches in flight")
            assert thread.is_alive(), "the flooding rank stopped"
            # Counted where the batches are served (the broker's completions of the flooder), not where the flooder's
            # training loop consumes them: its consumption lags its results by however much its thread is behind.
            before = flooder_completed(cluster, flooder)
            for n in range(6):
                light.generate_batch(**make_batch(1, 8, vocab, seed=50_000 + n))
            during = flooder_completed(cluster, flooder) - before
        finally:
            stop.set()
            thread.join(timeout=120)
            flooder.close()
            light.close()
        # Per light batch: one flooder batch in compute when it arrives, at most one ahead of it in the rotation.
        print(f"flooder batches during the light rank's 6: {during}")
        assert during <= 6 * 2 + 2, f"the flooder finished {during} batches while the light rank finished 6"
    finally:
        cluster.stop()
