"""A worker's protocol with the broker, without sockets, under a hand-turned clock: what it sends, what it hands on."""

from __future__ import annotations

import json

import pytest
from support.clock import Clock
from support.messages import INFO

from draftfeed.consumers.worker_session import RESET, STOP, Inbox, WorkerSession
from draftfeed.schemas.frames import pack
from draftfeed.schemas.messages import (
    Done,
    ErrorReply,
    ForgetMapping,
    ForgetRanks,
    Goodbye,
    Heartbeat,
    Liveness,
    RankAddress,
    Register,
    Registered,
    WorkerHeartbeat,
)

LIVENESS = Liveness(heartbeat_interval_s=1.0, liveness=3)  # silent for 3 s is dead


@pytest.fixture
def clock() -> Clock:
    return Clock(100.0)


@pytest.fixture
def session(clock) -> WorkerSession:
    registration = Register(worker="w1", service="svc", task="eagle3", engine="hf", info=INFO, capacity=1, host="h", pid=1)
    return WorkerSession(registration, "tcp://broker:1", WorkerHeartbeat, Inbox(), clock=clock)


def sent(session: WorkerSession) -> list[str]:
    """The types of what the outbox holds, in order; then empty it."""
    out = [json.loads(frames[1])["type"] for frames in session.outbox.pending()]
    session.outbox.clear()
    return out


def inbox(session: WorkerSession) -> list[str]:
    """What the compute loop would take now: message types, or RESET."""
    items = []
    while (item := session.inbox.get(0)) is not None:
        items.append(item if item == RESET else item[0].type)
    return items


def registered(instance: str = "b1") -> Registered:
    return Registered(broker="b", instance=instance, liveness=LIVENESS)


def test_a_silent_broker_gets_one_registration_per_liveness_period_and_the_queue_is_dropped(session, clock):
    session.register()
    session.on_broker(registered(), [])
    assert sent(session) == ["register"] and session.registrations == 1
    clock.now += 2.0
    session.beat()
    assert sent(session) == ["heartbeat"] and inbox(session) == []
    clock.now += 1.5
    session.beat()
    assert sent(session) == ["register", "heartbeat"]  # silent 3.5 s: register afresh
    assert inbox(session) == [RESET]  # the broker requeues what this worker held: the compute loop drops it
    clock.now += 1.0
    session.beat()
    assert sent(session) == ["heartbeat"] and inbox(session) == []  # one registration on its way at a time


def test_a_restarted_or_departing_broker_gets_a_registration_afresh(session, clock):
    session.register()
    session.on_broker(registered("b1"), [])
    sent(session)
    session.on_broker(Heartbeat(instance="b1"), [])
    assert sent(session) == []
    session.on_broker(Heartbeat(instance="b2"), [])
    assert sent(session) == ["register"] and inbox(session) == [RESET]
    session.on_broker(registered("b2"), [])
    session.on_broker(Goodbye(instance="b2"), [])
    assert sent(session) == ["register"] and inbox(session) == [RESET]


def test_a_refused_registration_ends_the_link_with_why(session):
    session.register()
    session.on_broker(ErrorReply(message="worker w1 serves another target than service 'svc'", code="refused"), [])
    assert session.ended and session.registered.is_set() and "another target" in session.refused


def test_a_refused_handshake_ends_the_link_with_why(session):
    session.register()
    session.handshake_refused("the broker refused this worker's key")
    assert session.ended and session.refused == "the broker refused this worker's key"


def test_a_broker_that_forgot_the_worker_gets_a_registration_afresh(session, clock):
    session.register()
    session.on_broker(registered(), [])
    sent(session)
    clock.now += 5  # the last registration was answered long ago
    session.on_broker(ErrorReply(message="worker w1 was forgotten: silent", code="forgotten"), [])
    assert sent(session) == ["register"] and not session.ended
    session.on_broker(ErrorReply(message="later registration refused: another target", code="refused"), [])
    assert session.ended  # refused while its registration afresh was on its way


def test_what_is_for_the_compute_loop_goes_there_in_order_and_forgets_are_counted(session):
    session.register()
    session.on_broker(registered(), [])
    session.on_broker(ForgetMapping(digest="d" * 16), [])
    session.on_broker(ForgetRanks(ranks=[RankAddress(rank="r1", data_endpoint="tcp://rank:1")]), [])
    session.on_broker(ForgetRanks(ranks=[RankAddress(rank="r1", data_endpoint="tcp://rank:1")]), [])
    assert session.inbox.forgets("tcp://rank:1") == 2 and session.inbox.forgets("tcp://rank:2") == 0
    assert inbox(session) == ["forget_mapping", "forget_ranks", "forget_ranks"]


def test_the_compute_loops_messages_go_in_order_and_stop_says_bye(session):
    session.register()
    sent(session)
    session.from_compute_loop(pack(Done(ticket=1, outcome="served")))
    session.from_compute_loop(pack(Done(ticket=2, outcome="failed")))
    assert not session.ended
    session.from_compute_loop([STOP])
    assert sent(session) == ["done", "done", "bye"] and session.ended
