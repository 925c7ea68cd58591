"""Where a rank's request is (issue 46): the broker's answer to ``where``, and the rank that asks when its answer shows
no progress for a liveness period and sends again what the broker no longer holds; both without sockets, under a
hand-turned clock."""

from __future__ import annotations

import json
import time

import pytest
from conftest import FAST_LIVENESS, WORKER_ENV, Cluster, assert_supervision_equal, make_batch, reference_eagle3
from support.clock import Clock
from support.messages import dispatches, frontend, hello, register, submit

from draftfeed import RemoteEagle3Target
from draftfeed.broker.settings import BrokerSettings
from draftfeed.broker.state import BrokerState
from draftfeed.processes import commands
from draftfeed.producers.rank_session import RankSession
from draftfeed.producers.requests import RequestKind, RequestTable
from draftfeed.schemas.messages import Computing, Done, Hello, Liveness, Place, Welcome, Where, Whereabouts

AUX = [1, 3, 4]  # the tiny target's default EAGLE-3 layers


def places(out: list) -> list[tuple]:
    """(request id, place, age, worker, outcome) of each place in the broker's whereabouts."""
    (answer,) = [m for m in frontend(out) if isinstance(m, Whereabouts)]
    return [(p.request_id, p.place, p.age_s, p.worker, p.outcome) for p in answer.places]


def test_the_broker_says_where_each_request_is():
    clock = Clock()
    state = BrokerState("test", BrokerSettings(heartbeat_interval_s=1.0, liveness=3), clock)
    register(state, "w1", capacity=2)
    hello(state, "r", window=3)
    ((_, first),) = dispatches(submit(state, "r", 0))
    clock.now = 1.0
    ((_, second),) = dispatches(submit(state, "r", 1))
    state.on_computing(b"w1", Computing(ticket=first.ticket))
    clock.now = 2.0
    assert dispatches(submit(state, "r", 2)) == []  # w1 is full: queued
    clock.now = 4.0
    state.on_done(b"w1", Done(ticket=first.ticket, outcome="served", next_ticket=second.ticket))  # r2 goes to w1 now
    clock.now = 5.0
    assert places(state.on_where(b"r", Where(request_ids=[0, 1, 2, 7]))) == [
        (0, "done", 1.0, "w1", "served"),  # its answer should have come: the rank sends it again
        (1, "computing", 4.0, "w1", None),
        (2, "at_worker", 1.0, "w1", None),
        (7, "unknown", 0.0, None, None),  # never sent, or sent to a broker that forgot it
    ]


def test_a_parked_request_and_one_of_a_forgotten_worker_are_placed_and_a_stranger_is_told_to_say_hello():
    clock = Clock()
    state = BrokerState("test", BrokerSettings(heartbeat_interval_s=1.0, liveness=3), clock)
    register(state, "w1")
    hello(state, "r", window=1)
    submit(state, "r", 0)
    submit(state, "r", 1)  # beyond the window: parked
    clock.now = 4.0
    hello(state, "other")  # heard; w1 is not
    state.on_rank_heartbeat(b"r")
    state.on_tick()  # w1 silent for 4 s: forgotten, request 0 queued again
    assert places(state.on_where(b"r", Where(request_ids=[0, 1]))) == [(0, "queued", 0.0, None, None), (1, "parked", 4.0, None, None)]
    (error,) = frontend(state.on_where(b"stranger", Where(request_ids=[0])))
    assert error.code == "unknown_peer"


LIVENESS = Liveness(heartbeat_interval_s=1.0, liveness=3)


@pytest.fixture
def clock() -> Clock:
    return Clock(100.0)


@pytest.fixture
def session(clock) -> RankSession:
    session = RankSession("rank-1", "tcp://broker:1", "svc", RequestTable(window=4, clock=clock), lambda _worker: None, clock=clock)
    session.hello = Hello(rank="rank-1", service="svc", data_endpoint="tcp://rank:2", window=4, host="h", pid=1)
    session.say_hello()
    session.on_broker(Welcome(broker="b", instance="b1", services={"svc": 1}, liveness=LIVENESS))
    session.outbox.clear()
    return session


def batch(session: RankSession) -> int:
    request_id, waiter = session.requests.add(lambda header, tensors: header, RequestKind.BATCH)
    waiter.frames = [b"sig", json.dumps({"type": "submit", "request_id": request_id}).encode()]
    session.send(request_id)
    return request_id


def sent(session: RankSession) -> list[str]:
    """What the outbox holds, as "type" or "type:ids", in order, heartbeats left out; then empty it."""
    out = []
    for frames in session.outbox.pending():
        header = json.loads(frames[1])
        if header["type"] == "where":
            out.append(f"where:{header['request_ids']}")
        elif header["type"] != "heartbeat":
            out.append(header["type"] + (f":{header['request_id']}" if "request_id" in header else ""))
    session.outbox.clear()
    return out


def beat(session: RankSession, clock: Clock, seconds: float) -> list[str]:
    """``seconds`` pass, the broker heard all along, then a beat; what went out."""
    clock.now += seconds
    session.broker.heard()
    session.beat()
    return sent(session)


def test_a_request_done_at_the_broker_whose_answer_never_came_is_sent_again_within_a_liveness_period(session, clock):
    first, second = batch(session), batch(session)
    assert sent(session) == [f"submit:{first}", f"submit:{second}"]
    assert beat(session, clock, 2.0) == []  # within the liveness period (3 s): nothing to ask
    assert beat(session, clock, 1.5) == [f"where:[{first}, {second}]"]
    session.on_broker(
        Whereabouts(
            places=[
                Place(request_id=first, place="done", age_s=2.5, worker="w1", outcome="served"),
                Place(request_id=second, place="computing", age_s=3.0, worker="w1"),
            ]
        )
    )
    assert sent(session) == [f"submit:{first}"]  # lost between w1's done and the rank: sent again at once
    assert session.stats.lost_resent == 1
    # The broker holds the second: asked again only after another liveness period; the first is new again.
    assert beat(session, clock, 1.0) == []
    assert beat(session, clock, 2.5) == [f"where:[{first}, {second}]"]
    session.on_broker(
        Whereabouts(places=[Place(request_id=first, place="queued", age_s=2.0), Place(request_id=second, place="computing", age_s=6.5, worker="w1")])
    )
    assert sent(session) == []
    assert session.requests.describe(second) == f"request {second} was computing at worker w1 for 6.5 s, as the broker said 0.0 s ago"
    assert "sent again 1 time after the broker had lost track of it" in session.requests.describe(first)


def test_a_request_done_a_moment_ago_or_answered_meanwhile_is_not_sent_again(session, clock):
    first, second = batch(session), batch(session)
    sent(session)
    assert beat(session, clock, 3.5) == [f"where:[{first}, {second}]"]
    session.requests.resolve(second, header={})  # its answer came after the where went
    session.on_broker(
        Whereabouts(
            places=[
                Place(request_id=first, place="done", age_s=0.5, worker="w1", outcome="served"),
                Place(request_id=second, place="done", age_s=5.0, worker="w1", outcome="served"),
            ]
        )
    )
    assert sent(session) == [] and session.stats.lost_resent == 0  # done 0.5 s ago: its answer may be on its way
    assert beat(session, clock, 1.0) == [f"where:[{first}]"]  # asked again at the next beat
    session.on_broker(Whereabouts(places=[Place(request_id=first, place="unknown")]))
    assert sent(session) == [f"submit:{first}"]


def test_an_unanswered_where_is_asked_again_each_beat_and_said_in_the_timeout(session, clock):
    (first,) = [batch(session)]
    sent(session)
    assert beat(session, clock, 3.5) == [f"where:[{first}]"]
    assert beat(session, clock, 1.0) == [f"where:[{first}]"]
    assert (
        session.requests.describe(first)
        == f"request {first} was never acknowledged: the broker has not said where it is (asked 2 times, last 0.0 s ago)"
    )
    assert session.requests.oldest_s() == 4.5  # what the rank's metric draftfeed_rank_oldest_request_seconds shows
    session.requests.resolve(first, header={})
    assert session.requests.oldest_s() == 0.0


def test_an_answer_arriving_in_pieces_is_progress_and_a_silent_broker_is_not_asked(session, clock):
    first = batch(session)
    sent(session)
    clock.now += 2.5
    session.requests.get(first).future.progressed_at = clock.now  # a piece came
    assert beat(session, clock, 1.0) == []
    clock.now += 10.0  # the broker silent: the rank says hello again, and asks nothing of a broker it has lost
    session.beat()
    assert sent(session) == ["hello"]


# ---------------------------------------------------------------- end to end: a real broker, worker and rank
def test_an_answer_lost_after_its_workers_done_is_asked_about_and_sent_again(tiny_target, tiny_model):
    """The worker says served, the broker lets the request go, and the answer never comes (tests/fake_lost_answers.py):
    the rank asks where it is once its answer has shown no progress for a liveness period, hears "done" and sends it
    again; every batch arrives once, in order, equal to the in-process target. Before whereabouts the batch waited for
    its request_timeout and failed."""
    cluster = Cluster(*FAST_LIVENESS)
    try:
        worker = commands.start(
            ["worker", "--broker", cluster.backend, "--target", str(tiny_target), "--service", "lost", "--name", "loser"],
            env={**WORKER_ENV, "FAKE_LOSE": "2"},
            module="fake_lost_answers",
        )
        cluster.workers.append(worker)
        batches = [make_batch(2, 24, 1000, seed=60 + index) for index in range(5)]
        started = time.monotonic()
        with RemoteEagle3Target(cluster.frontend, "lost", prefetch_depth=2, request_timeout=60) as remote:
            received = 0
            for (batch, supervision), sent in zip(remote.iterate(batches), batches, strict=True):
                assert batch is sent
                assert_supervision_equal(supervision, reference_eagle3(tiny_model, batch, AUX))
                received += 1
            stats = remote.connection_stats
        took = time.monotonic() - started
        assert received == len(batches)
        assert stats.lost_resent == 1 and stats.where_asked >= 1, stats
        assert took < 30, f"the lost answer took {took:.0f} s to be asked for again (liveness period 1.6 s)"
    finally:
        cluster.stop()
