"""What counts against a request's --max-attempts (issue 15), in the broker's policy with a hand-turned clock: only
a try that failed in an engine (the worker died computing it, or could not run it), never a worker's death while
the request waited in its queue, nor a worker that was only frozen and came back."""

from __future__ import annotations

import pytest
import torch
from support.clock import Clock
from support.messages import dispatches, errors, hello, register, submit

from draftfeed.broker.settings import BrokerSettings
from draftfeed.broker.state import BrokerState
from draftfeed.schemas.messages import Computing, Done, WorkerHeartbeat

INPUT = {"input_ids": torch.zeros(1, 1, dtype=torch.int64)}


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def state(clock) -> BrokerState:
    return BrokerState("test", BrokerSettings(heartbeat_interval_s=1.0, liveness=3, max_attempts=3), clock)


def beat(state: BrokerState, worker: str, in_engine: int | None = None):
    """A heartbeat from ``worker``; ``in_engine``: first its word that it computes that ticket (``computing``)."""
    if in_engine is not None:
        state.on_computing(worker.encode(), Computing(ticket=in_engine))
    return state.on_worker_heartbeat(worker.encode(), WorkerHeartbeat())


def kill(state: BrokerState, clock: Clock, worker: str, keep: list[str]):
    """Let ``worker`` fall silent past the window while the ``keep`` workers and the rank stay heard."""
    clock.now += 3.5
    for other in keep:
        beat(state, other)
    state.on_rank_heartbeat(b"r")
    return state.on_tick()


def test_a_death_charges_the_request_in_the_engine_not_those_queued_behind_it(state, clock):
    hello(state, "r", window=4)
    register(state, "w1", capacity=2)
    first = dispatches(submit(state, "r", 0, tensors=INPUT))[0][1]
    dispatches(submit(state, "r", 1, tensors=INPUT))
    beat(state, "w1", in_engine=first.ticket)
    register(state, "w2", capacity=2)  # joins after; both requests stay at w1 until it dies
    kill(state, clock, "w1", keep=["w2"])
    in_engine, queued = state.ranks[b"r"].requests[0], state.ranks[b"r"].requests[1]
    assert in_engine.failures == 1 and "worker w1 died with it in its engine" in in_engine.attempts[0][1]
    assert queued.failures == 0 and queued.attempts == []
    assert state.status()["requeues"] == {"died_in_engine": 1, "worker_gone": 1}


def test_a_request_that_only_waits_at_dying_workers_never_fails(state, clock):
    """Request 0 is in the engine of each of five dying workers (it fails after three); request 1 waits behind it
    at every one of them and is never charged (the old policy failed it with request 0)."""
    hello(state, "r", window=4)
    names = [f"w{i}" for i in range(5)]
    register(state, names[0], capacity=2)
    dispatches(submit(state, "r", 0, tensors=INPUT))
    dispatches(submit(state, "r", 1, tensors=INPUT))
    failed = []
    for index, name in enumerate(names):
        held = {p.request.request_id: p.ticket for p in state.workers[name.encode()].in_flight.values()}
        beat(state, name, in_engine=held.get(0))
        if index + 1 < len(names):
            register(state, names[index + 1], capacity=2)
        failed += [e.request_id for e in errors(kill(state, clock, name, keep=names[index + 1 : index + 2]))]
    assert failed == [0]
    assert state.ranks[b"r"].requests[1].failures == 0 and 1 in state.ranks[b"r"].requests


def test_a_poison_batch_fails_after_max_attempts_naming_itself_and_each_try(state, clock):
    hello(state, "r", window=4)
    out = []
    for index in range(3):
        register(state, f"w{index}", capacity=2)
        pending_ticket = next(iter(state.workers[f"w{index}".encode()].in_flight), None)
        if pending_ticket is None:
            pending_ticket = dispatches(submit(state, "r", 7, tensors=INPUT))[0][1].ticket
        beat(state, f"w{index}", in_engine=pending_ticket)
        out = kill(state, clock, f"w{index}", keep=[])
    (failure,) = errors(out)
    assert failure.request_id == 7 and failure.code == "failed"
    assert "request 7 of rank r (input_ids [1, 1]) failed on 3 workers of service 'svc' (--max-attempts 3)" in failure.message
    assert all(f"worker w{i} died with it in its engine" in failure.message for i in range(3))
    assert state.counters["requests_failed"] == 1


def test_a_frozen_worker_that_comes_back_charges_nothing(state, clock):
    hello(state, "r", window=4)
    register(state, "w1", capacity=2)
    first = dispatches(submit(state, "r", 0, tensors=INPUT))[0][1]
    beat(state, "w1", in_engine=first.ticket)
    register(state, "w2", capacity=2)
    kill(state, clock, "w1", keep=["w2"])  # frozen past the window: looks dead
    assert state.ranks[b"r"].requests[0].failures == 1
    register(state, "w1", capacity=2)  # thawed: it registers again
    pending = state.ranks[b"r"].requests[0]
    assert pending.failures == 0 and pending.attempts == [] and b"w1" not in pending.excluded


def test_an_engine_that_cannot_run_a_batch_counts_draining_does_not(state):
    hello(state, "r", window=4)
    register(state, "w1", capacity=1)
    register(state, "w2", capacity=1)
    register(state, "w3", capacity=1)
    peer, dispatch = dispatches(submit(state, "r", 0, tensors=INPUT))[0]
    out = state.on_done(peer, Done(ticket=dispatch.ticket, outcome="draining", message="worker draining"))
    assert state.ranks[b"r"].requests[0].failures == 0
    for _ in range(3):
        peer, dispatch = dispatches(out)[0]
        out = state.on_done(peer, Done(ticket=dispatch.ticket, outcome="retry", message="OutOfMemoryError: CUDA out of memory"))
    (failure,) = errors(out)
    assert failure.message.count("OutOfMemoryError: CUDA out of memory") == 3
    assert state.status()["requeues"] == {"draining": 1, "retry": 2}


def test_an_answer_that_stalled_is_sent_again_once_uncharged_then_fails_naming_both_stalls(state):
    """A rank that stopped taking its answer (the worker's --send-timeout passed, partway through a large one or before
    it): the request goes out again, not charged against --max-attempts; a second stall fails it."""
    hello(state, "r", window=4)
    register(state, "w1", capacity=1)
    register(state, "w2", capacity=1)
    peer, dispatch = dispatches(submit(state, "r", 0, tensors=INPUT))[0]
    out = state.on_done(peer, Done(ticket=dispatch.ticket, outcome="stalled", message="answer not delivered: rank stalled"))
    pending = state.ranks[b"r"].requests[0]
    assert pending.failures == 0 and pending.stalled and errors(out) == []
    peer, dispatch = dispatches(out)[0]
    out = state.on_done(peer, Done(ticket=dispatch.ticket, outcome="stalled", message="answer not delivered: rank stalled"))
    (failure,) = errors(out)
    assert "stalled twice on the way to the rank" in failure.message and "\n" not in failure.message, failure.message
    assert 0 not in state.ranks[b"r"].requests
    assert state.status()["requeues"] == {"stalled": 1} and state.status()["counters"]["requests_failed"] == 1


def poisoned(state: BrokerState, clock: Clock, request_id: int, names: list[str]) -> list:
    """Each of ``names`` registers, is given the request (already queued, or submitted now), says it computes it and
    dies; the broker's replies to the last death."""
    out: list = []
    for name in names:
        out = register(state, name, capacity=2)
        ticket = next((p.ticket for p in state.workers[name.encode()].in_flight.values() if p.request.request_id == request_id), None)
        if ticket is None:
            ticket = dispatches(submit(state, "r", request_id, tensors=INPUT))[0][1].ticket
        beat(state, name, in_engine=ticket)
        out = kill(state, clock, name, keep=[])
    return out


def test_deaths_that_churn_explains_charge_no_batch_until_the_window_passes(state, clock):
    """Request 5's worker dies and another serves it: the workers die for reasons not their batches' (an operator,
    a lost node). For --churn-window after that, request 7 in the engine of three dying workers is not failed as
    poison; once the window has passed without new evidence, its next death fails it, naming every try."""
    hello(state, "r", window=4)
    assert errors(poisoned(state, clock, 5, ["a0"])) == []
    peer, dispatch = dispatches(register(state, "a1", capacity=2))[0]
    state.on_done(peer, Done(ticket=dispatch.ticket, outcome="served"))  # request 5, charged with a death, is served
    state.on_worker_bye(b"a1")  # it leaves, as one that says goodbye: no death, no evidence
    assert state.deaths.churning("svc")
    assert errors(poisoned(state, clock, 7, ["w0", "w1", "w2"])) == []
    pending = state.ranks[b"r"].requests[7]
    assert pending.failures == 3 and pending.own_failures(churning=True) == 0
    clock.now += BrokerSettings().churn_window_s
    (failure,) = errors(poisoned(state, clock, 7, ["w3"]))
    assert failure.request_id == 7 and "failed on 4 workers of service 'svc' (--max-attempts 3)" in failure.message
    assert "its workers' deaths count as its own" in failure.message


def test_a_worker_that_dies_holding_nothing_is_evidence_of_churn_one_holding_requests_is_not(state, clock):
    hello(state, "r", window=4)
    register(state, "idle", capacity=1)
    kill(state, clock, "idle", keep=[])
    assert state.deaths.churning("svc")
    clock.now += BrokerSettings().churn_window_s + 1
    assert not state.deaths.churning("svc")
    assert errors(poisoned(state, clock, 7, ["w0", "w1"])) == [] and not state.deaths.churning("svc")
    (failure,) = errors(poisoned(state, clock, 7, ["w2"]))
    assert failure.request_id == 7
