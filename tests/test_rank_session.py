"""A rank's protocol with the broker, without sockets, under a hand-turned clock: what it sends and when."""

from __future__ import annotations

import json

import pytest
from support.clock import Clock

from draftfeed.producers.rank_session import RankSession
from draftfeed.producers.requests import RequestKind, RequestTable
from draftfeed.schemas.errors import RemoteTargetError
from draftfeed.schemas.messages import ErrorReply, Failure, Goodbye, Heartbeat, Hello, Liveness, Result, Welcome, WorkersGone

LIVENESS = Liveness(heartbeat_interval_s=1.0, liveness=3)  # silent for 3 s is dead


@pytest.fixture
def clock() -> Clock:
    return Clock(100.0)


@pytest.fixture
def session(clock) -> RankSession:
    gone: list[str] = []
    session = RankSession("rank-1", "tcp://broker:1", "svc", RequestTable(window=4, clock=clock), gone.append, clock=clock)
    session.hello = Hello(rank="rank-1", service="svc", data_endpoint="tcp://rank:2", window=4, host="h", pid=1)
    session.gone = gone  # type: ignore[attr-defined]  # what on_worker_gone was told
    return session


def sent(session: RankSession) -> list[str]:
    """What the outbox holds, as "type" or "type:request_id", in order; then empty it."""
    out = []
    for frames in session.outbox.pending():
        header = json.loads(frames[1])
        out.append(header["type"] + (f":{header['request_id']}" if "request_id" in header else ""))
    session.outbox.clear()
    return out


def welcome(instance: str = "b1", resumed: bool = False) -> Welcome:
    return Welcome(broker="b", instance=instance, resumed=resumed, services={"svc": 1}, liveness=LIVENESS)


def request(session: RankSession, kind: RequestKind = RequestKind.BATCH, mapping: str | None = None) -> int:
    """A request as a caller adds it: packed on its thread, then handed over."""
    request_id, waiter = session.requests.add(lambda header, tensors: header, kind, mapping=mapping)
    message = {"type": "set_mapping" if kind is RequestKind.SET_MAPPING else "submit", "request_id": request_id}
    waiter.frames = [b"sig", json.dumps(message).encode()]
    session.send(request_id)
    return request_id


def test_a_silent_broker_gets_one_hello_per_liveness_period(session, clock):
    session.say_hello()
    session.on_broker(welcome())
    assert sent(session) == ["hello"] and session.answered
    clock.now += 2.0
    session.beat()
    assert sent(session) == ["heartbeat"]  # heard 2 s ago: within 3 s
    clock.now += 1.5
    session.beat()
    assert sent(session) == ["heartbeat", "hello"]  # silent 3.5 s: introduce again
    clock.now += 1.0
    session.beat()
    assert sent(session) == ["heartbeat"]  # a hello is on its way since 1 s: not another one
    clock.now += 2.5
    session.beat()
    assert sent(session) == ["heartbeat", "hello"]  # that one went unanswered for a whole period


def test_a_restarted_broker_gets_the_mappings_then_every_unanswered_request_in_order(session, clock):
    session.say_hello()
    session.on_broker(welcome("b1"))
    mapping = request(session, RequestKind.SET_MAPPING, mapping="m1")
    session.requests.resolve(mapping)
    first, second = request(session, mapping="m1"), request(session, mapping="m1")
    session.requests.resolve(first)
    third = request(session)
    sent(session)
    session.on_broker(Heartbeat(instance="b2"))  # another instance: it has not welcomed this rank
    assert sent(session) == ["hello"]
    session.on_broker(welcome("b2", resumed=False))
    assert sent(session) == [f"set_mapping:{mapping}", f"submit:{second}", f"submit:{third}"]
    assert session.stats.resyncs == 1


def test_a_busy_request_goes_again_after_its_backoff(session, clock):
    session.on_broker(welcome())
    request_id = request(session)
    sent(session)
    session.on_broker(ErrorReply(request_id=request_id, message="queue full", code="busy"))
    session.turn()
    assert sent(session) == []
    clock.now += 0.5
    session.turn()
    assert sent(session) == [f"submit:{request_id}"] and session.stats.busy_retries == 1


def test_a_request_whose_mapping_the_broker_lacks_goes_again_behind_it(session):
    session.on_broker(welcome())
    mapping = request(session, RequestKind.SET_MAPPING, mapping="m1")
    request_id = request(session, mapping="m1")
    sent(session)
    session.on_broker(ErrorReply(request_id=request_id, message="no mapping m1", code="unknown_mapping"))
    assert sent(session) == [f"set_mapping:{mapping}", f"submit:{request_id}"]


def test_a_refusal_of_the_rank_breaks_it_and_fails_every_request(session):
    session.on_broker(welcome())
    futures = [session.requests.get(request(session)).future for _ in range(2)]
    session.on_broker(ErrorReply(message="service svc serves another target", code="mismatch"))
    assert isinstance(session.broken, RemoteTargetError) and "refused this rank: service svc serves another target" in str(session.broken)
    for future in futures:
        with pytest.raises(RemoteTargetError, match="another target"):
            future.result(0)


def test_a_refused_handshake_is_why_no_broker_answers(session):
    session.say_hello()
    session.handshake_refused("the broker refused this rank's key")
    assert session.answered and str(session.broken) == "the broker refused this rank's key"


def test_the_first_answer_wins_and_the_others_are_counted(session):
    session.on_broker(welcome())
    request_id = request(session)
    token = session.requests.get(request_id).token
    future = session.requests.get(request_id).future
    result = Result(request_id=request_id, token=token, kind="eagle3", worker="w", tensors=[])
    session.on_answer(result.model_copy(update={"token": token + 1}), dict)
    session.on_answer(result, dict)
    session.on_answer(Failure(request_id=request_id, token=token, worker="w2", message="late"), dict)
    assert future.result(0) == result
    assert (session.stats.foreign_dropped, session.stats.duplicates_dropped) == (1, 1)


def test_an_answer_lost_on_a_pair_is_asked_for_again_under_a_new_id(session):
    session.on_broker(welcome())
    request_id = request(session)
    sent(session)
    session.ask_again(request_id, "the pair group failed")
    (again,) = sent(session)
    new_id = int(again.split(":")[1])
    assert new_id != request_id and session.requests.get(new_id) is session.requests.get(request_id)
    assert session.stats.lost_over_pair == 1


def test_goodbye_and_a_gone_worker_are_told(session, clock):
    session.on_broker(welcome())
    session.on_broker(WorkersGone(workers=["w1"]))
    assert session.gone == ["w1"]
    session.on_broker(Goodbye(instance="b1"))
    assert sent(session) == ["hello"]
    clock.now += 7
    assert "shut down 7 s ago" in session.describe_broker()
