"""The broker's policy for vocab mappings and forgotten peers (issue 13), on its own, with a hand-turned clock.

A request names the mapping it is computed with; the broker never dispatches it without that mapping, keeps
a mapping while a live request names it, and forgets what a worker holds when the worker does.
"""

from __future__ import annotations

import logging

import pytest
from support.clock import Clock
from support.messages import backend, dispatches, frontend, hello, only, register, submit, welcome

from draftfeed.broker.settings import BrokerSettings
from draftfeed.broker.state import BrokerState
from draftfeed.schemas.messages import (
    Dispatch,
    Done,
    ErrorReply,
    ForgetMapping,
    ForgetRanks,
    SetVocabMapping,
    TensorSpec,
    VocabMapping,
    WorkerHeartbeat,
)

DIGEST_A = "a" * 32
DIGEST_B = "b" * 32


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def state(clock) -> BrokerState:
    return BrokerState("test", BrokerSettings(heartbeat_interval_s=1.0, liveness=3), clock)


def set_mapping(state: BrokerState, digest: str, rank: str = "r", request_id: int = 900):
    specs = [TensorSpec(name="selected_token_ids", dtype="int64", shape=[2]), TensorSpec(name="selected_token_mask", dtype="bool", shape=[4])]
    return state.on_set_vocab_mapping(rank.encode(), SetVocabMapping(request_id=request_id, digest=digest, tensors=specs), [b"\0" * 16, b"\0" * 4])


def test_a_request_naming_a_mapping_the_broker_lacks_is_refused_for_a_resend(state):
    register(state, "w1")
    welcome(hello(state, window=4))
    (refusal,) = frontend(submit(state, "r", 0, DIGEST_A))
    assert isinstance(refusal, ErrorReply) and refusal.code == "unknown_mapping" and refusal.request_id == 0
    assert DIGEST_A in refusal.message and "send the mapping, then the request again" in refusal.message
    assert state.ranks[b"r"].outstanding == 0
    set_mapping(state, DIGEST_A)
    sent = backend(submit(state, "r", 0, DIGEST_A), "w1")
    assert [type(m) for m in sent] == [VocabMapping, Dispatch]  # the mapping goes first
    assert sent[0].digest == DIGEST_A and sent[1].request.mapping_digest == DIGEST_A


def test_a_forgotten_rank_is_told_so_then_resyncs_fully(state, clock, caplog):
    register(state, "w1", capacity=2)
    assert welcome(hello(state, window=4)).resumed is False
    set_mapping(state, DIGEST_A)
    assert only(backend(submit(state, "r", 0, DIGEST_A)), Dispatch)
    clock.now = 2.0
    state.on_worker_heartbeat(b"w1", WorkerHeartbeat())
    assert welcome(hello(state, window=4)).resumed is True  # the same rank again, still known: nothing to resend
    clock.now = 5.5  # the rank last heard at 2.0 (its hello): silent for 3.5 s > the 3 s window; the worker heard now
    state.on_worker_heartbeat(b"w1", WorkerHeartbeat())
    with caplog.at_level(logging.INFO, logger="draftfeed.broker"):
        out = state.on_tick()
    assert "broker: forgot rank r of service 'svc': silent for 3.5 s (liveness period 3.0 s)" in caplog.text
    # The worker forgets the rank first, then the mapping no one needs any more.
    assert [type(m) for m in backend(state.notices.ordered(out), "w1") if not m.type == "heartbeat"] == [ForgetRanks, ForgetMapping]
    (told,) = only(frontend(state.on_rank_heartbeat(b"r")), ErrorReply)
    assert told.code == "forgotten" and "forgot this rank: silent for 3.5 s" in told.message
    (refused,) = frontend(submit(state, "r", 1, DIGEST_A))
    assert refused.code == "forgotten"
    # Its hello: a new record, and the welcome says the broker holds nothing of it.
    assert welcome(hello(state, window=4)).resumed is False
    (refusal,) = frontend(submit(state, "r", 0, DIGEST_A))  # a batch that overtook the resync: never computed without A
    assert refusal.code == "unknown_mapping"
    set_mapping(state, DIGEST_A)
    sent = backend(submit(state, "r", 0, DIGEST_A), "w1")
    assert [type(m) for m in sent] == [VocabMapping, Dispatch]  # the worker was told to forget A: it gets A again


def test_an_old_request_of_a_forgotten_rank_is_never_dispatched_for_its_new_record(state, clock):
    register(state, "w1")
    welcome(hello(state, window=4))
    set_mapping(state, DIGEST_A)
    ((_, old),) = dispatches(submit(state, "r", 0, DIGEST_A))
    clock.now = 3.5
    state.on_worker_heartbeat(b"w1", WorkerHeartbeat())
    state.on_tick()  # forgets the rank
    welcome(hello(state, window=4))  # back, empty
    # The worker hands the old request back (e.g. draining): it belongs to a forgotten record and goes nowhere.
    out = state.on_done(b"w1", Done(ticket=old.ticket, outcome="draining", message="worker draining"))
    assert only(backend(out), Dispatch) == [] and not state.services["svc"].queue


def test_a_worker_lacking_a_mapping_gets_it_again_before_the_request(state):
    register(state, "w1")
    welcome(hello(state, window=4))
    set_mapping(state, DIGEST_A)
    (first,) = only(backend(submit(state, "r", 0, DIGEST_A)), Dispatch)
    out = state.on_done(b"w1", Done(ticket=first.ticket, outcome="missing_mapping", missing_mapping=DIGEST_A, message="no vocab mapping"))
    sent = backend(out, "w1")
    assert [type(m) for m in sent] == [VocabMapping, Dispatch] and sent[1].request.request_id == 0
    assert state.services["svc"].queue.count(b"r") == 0 and state.counters["mappings_resent"] == 1
    pending = state.ranks[b"r"].requests[0]
    assert pending.failures == 0 and not pending.excluded  # not the request's fault, nor counted against it
    # The same worker again: it cannot keep the mapping; that counts as a failure on it.
    state.on_done(b"w1", Done(ticket=sent[1].ticket, outcome="missing_mapping", missing_mapping=DIGEST_A, message="no vocab mapping"))
    assert pending.failures == 1 and pending.excluded == {b"w1"}


def test_a_worker_registering_again_is_sent_its_mappings_again(state):
    register(state, "w1", capacity=2)
    welcome(hello(state, window=4))
    set_mapping(state, DIGEST_A)
    (first,) = only(backend(submit(state, "r", 0, DIGEST_A)), Dispatch)
    out = register(state, "w1", capacity=2)  # it lost sight of the broker and dropped what it held
    assert [type(m) for m in backend(out, "w1") if m.type in ("vocab_mapping", "dispatch")] == [VocabMapping, Dispatch]


def test_a_mapping_lives_while_a_request_names_it(state):
    register(state, "w1")
    welcome(hello(state, window=4))
    set_mapping(state, DIGEST_A)
    (first,) = only(backend(submit(state, "r", 0, DIGEST_A)), Dispatch)
    assert only(backend(set_mapping(state, DIGEST_B)), ForgetMapping) == []  # request 0 still names A
    assert only(frontend(submit(state, "r", 1, DIGEST_A)), ErrorReply) == []  # so A is still held
    out = state.on_done(b"w1", Done(ticket=first.ticket, outcome="served"))
    (second,) = only(backend(out), Dispatch)
    assert second.request.request_id == 1 and only(backend(out), ForgetMapping) == []
    out = state.on_done(b"w1", Done(ticket=second.ticket, outcome="served"))
    assert [m.digest for m in only(backend(out), ForgetMapping)] == [DIGEST_A]
    assert list(state.mappings.records) == [DIGEST_B]


def test_a_forgotten_worker_is_told_so(state, clock, caplog):
    register(state, "w1")
    clock.now = 3.5
    with caplog.at_level(logging.INFO, logger="draftfeed.broker"):
        state.on_tick()
    assert "broker: forgot worker w1 of service 'svc': silent for 3.5 s (liveness period 3.0 s)" in caplog.text
    (told,) = backend(state.on_worker_heartbeat(b"w1", WorkerHeartbeat()))
    assert isinstance(told, ErrorReply) and told.code == "forgotten" and "forgot this worker: silent for 3.5 s" in told.message
