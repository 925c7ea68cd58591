"""The broker's policy on its own (no sockets): dispatch, credits, windows, requeues, refusals."""

from __future__ import annotations

import pytest
from support.clock import Clock
from support.messages import INFO, dispatches, errors, hello, register, submit

from draftfeed.broker.settings import BrokerSettings
from draftfeed.broker.state import BrokerState
from draftfeed.schemas.frames import unpack
from draftfeed.schemas.messages import (
    BACKEND_OUTBOUND,
    FRONTEND_OUTBOUND,
    DataPlaneOffer,
    Dispatch,
    Done,
    DSparkTargetInfo,
    ErrorReply,
    Hello,
    PairStatus,
    Submit,
    TensorSpec,
    WorkerHeartbeat,
    WorkersGone,
    dispatch_header,
    dispatch_rank_fields,
)


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def state(clock) -> BrokerState:
    return BrokerState("test", BrokerSettings(heartbeat_interval_s=1.0, liveness=3, max_queued_per_service=4), clock)


def test_dispatch_header_is_the_dispatch_model():
    hello = Hello(rank='c"x', service="s\\1", data_endpoint="tcp://1.2.3.4:5", window=2, host="h", pid=1)
    for digest in (None, "abcdef0123456789"):
        request = Submit(
            request_id=3, kind="eagle3", token=9, mapping_digest=digest, tensors=[TensorSpec(name="input_ids", dtype="int64", shape=[1, 2])]
        )
        parsed = Dispatch.model_validate_json(dispatch_header(17, dispatch_rank_fields(hello, None), request.model_dump_json().encode()))
        assert parsed == Dispatch(ticket=17, rank='c"x', data_endpoint="tcp://1.2.3.4:5", service="s\\1", request=request)


def test_dispatch_header_carries_the_ranks_data_plane_offer_key_and_limit():
    offer = DataPlaneOffer(mode="gloo", host_id="boot-1", hostname="n1", device="cuda:1", gpu_uuid="GPU-1", nccl=True)
    hello = Hello(rank="c", service="s", data_endpoint="tcp://1.2.3.4:5", window=2, host="h", pid=1, data_plane=offer, max_result_bytes=77)
    key = "k" * 40
    parsed = Dispatch.model_validate_json(
        dispatch_header(1, dispatch_rank_fields(hello, key), Submit(request_id=3, kind="eagle3").model_dump_json().encode())
    )
    assert parsed.data_plane == offer and parsed.reply_key == key and parsed.max_result_bytes == 77


def test_ranks_a_worker_served_are_told_it_is_gone_and_pairs_show_in_status(state):
    register(state, "w1")
    hello(state, "r1")
    hello(state, "r2")
    assert dispatches(submit(state, "r1", 0))
    pair = PairStatus(rank="r1", plane="gloo", state="ready", reason="the worker asked for gloo", generation=0, sent_over_pair=3)
    state.on_worker_heartbeat(b"w1", WorkerHeartbeat(pairs=[pair], pair_count=1))
    assert state.status()["services"]["svc"]["workers"][0]["pairs"] == [pair.model_dump(mode="json")]
    out = state.notices.ordered(state.on_worker_bye(b"w1"))
    # Only the rank it served hears of it (r2 never had a pair with it).
    told = [(i.peer, m) for i in out if i.side == "frontend" and isinstance(m := unpack(i.frames, FRONTEND_OUTBOUND)[0], WorkersGone)]
    assert told == [(b"r1", WorkersGone(workers=["w1"]))]


def test_requests_go_to_the_worker_with_free_credits_and_wait_for_one(state):
    register(state, "w1")
    register(state, "w2")
    hello(state, "r", window=4)
    first = dispatches(submit(state, "r", 0)) + dispatches(submit(state, "r", 1))
    assert sorted(peer for peer, _ in first) == [b"w1", b"w2"]
    assert dispatches(submit(state, "r", 2)) == []  # both workers full: it queues
    ticket = next(d.ticket for peer, d in first if peer == b"w1")
    ((peer, dispatch),) = dispatches(state.on_done(b"w1", Done(ticket=ticket, outcome="served")))
    assert peer == b"w1" and dispatch.request.request_id == 2


def test_a_dead_worker_requeues_under_a_new_ticket_and_its_late_done_is_ignored(state, clock):
    register(state, "w1")
    hello(state, "r")
    ((_, old),) = dispatches(submit(state, "r", 0))
    clock.now = 2.0
    register(state, "w2")
    state.on_rank_heartbeat(b"r")
    state.on_worker_heartbeat(b"w2", WorkerHeartbeat())
    clock.now = 3.5  # w1 silent for 3.5 s > 3 s window; w2 and r heard at 2.0
    ((peer, new),) = dispatches(state.on_tick())
    assert peer == b"w2" and new.request.request_id == 0 and new.ticket != old.ticket
    assert state.on_done(b"w2", Done(ticket=old.ticket, outcome="served")) == []  # an old ticket matches nothing
    assert state.ranks[b"r"].outstanding == 1
    state.on_done(b"w2", Done(ticket=new.ticket, outcome="served"))
    assert state.ranks[b"r"].outstanding == 0 and state.ranks[b"r"].completed == 1


def test_requests_past_the_window_are_parked_then_answered_busy(state):
    hello(state, "r", window=1)
    submit(state, "r", 0)
    assert submit(state, "r", 1) == []  # parked: sent after a result, before its done
    (refusal,) = errors(submit(state, "r", 2))
    assert refusal.request_id == 2 and refusal.code == "busy"
    assert "2 requests held (0 queued, 1 parked) and its prefetch window is 1" in refusal.message
    assert sorted(state.ranks[b"r"].requests) == [0, 1], "a busy request is not held"
    assert submit(state, "r", 0) == []  # a resend of a held request is ignored


def test_a_full_service_queue_answers_busy(state):
    for index in range(3):
        hello(state, f"r{index}", window=2)
    for index in range(2):
        submit(state, f"r{index}", 0)
        submit(state, f"r{index}", 1)
    (busy,) = errors(submit(state, "r2", 0))
    assert busy.code == "busy" and "limit" in busy.message


def test_a_worker_of_another_target_is_refused(state):
    register(state, "w1")
    out = register(state, "w2", info=INFO.model_copy(update={"aux_layer_ids": [0, 3, 4]}))
    (refusal,) = [unpack(i.frames, BACKEND_OUTBOUND)[0] for i in out]
    assert (
        isinstance(refusal, ErrorReply)
        and refusal.code == "refused"
        and "aux_layer_ids: worker has [0, 3, 4], service has [1, 3, 4]" in refusal.message
    )
    out = register(state, "w3", info=DSparkTargetInfo(num_hidden_layers=8, hidden_size=64, vocab_size=1000, target_layer_ids=[1, 2]))
    assert "task: worker has 'dspark', service has 'eagle3'" in unpack(out[0].frames, BACKEND_OUTBOUND)[0].message
    assert list(state.services["svc"].workers) == [b"w1"] and state.counters["workers_refused"] == 2


def test_unknown_peers_are_told_to_introduce_themselves(state):
    (reply,) = errors(submit(state, "stranger", 5))
    assert reply.code == "unknown_peer" and reply.request_id == 5
    (reply,) = [unpack(i.frames, BACKEND_OUTBOUND)[0] for i in state.on_done(b"ghost", Done(ticket=1, outcome="served"))]
    assert reply.code == "unknown_peer"


def test_a_hello_must_name_its_own_connection(state):
    out = state.on_hello(b"someone-else", Hello(rank="victim", service="svc", data_endpoint="tcp://x:1", window=2, host="h", pid=1))
    (reply,) = errors(out)
    assert "a rank speaks only for itself" in reply.message and b"someone-else" not in state.ranks


def test_requests_whose_frames_do_not_match_their_header_are_refused_before_queueing(state):
    register(state, "w1")
    hello(state, "r")
    spec = TensorSpec(name="input_ids", dtype="int64", shape=[2, 3])
    (short,) = errors(state.on_submit(b"r", Submit(request_id=1, kind="eagle3", tensors=[spec]), [b"\0" * 40]))
    assert short.request_id == 1 and "needs 48 bytes but its frame holds 40" in short.message
    (huge,) = errors(
        state.on_submit(b"r", Submit(request_id=2, kind="eagle3", tensors=[spec.model_copy(update={"shape": [1 << 30, 1 << 30]})]), [b""])
    )
    assert "over the limit" in huge.message
    assert state.ranks[b"r"].outstanding == 0 and not state.services["svc"].queue


def test_a_stale_entry_of_a_workers_old_record_never_passes_for_its_new_record():
    """A worker that registers again is a new record under the same peer. The free-worker heap keeps stale entries
    of the old record; none may pass for the new one (a dispatch booked on the old record never completes: its done
    finds no such ticket), whatever versions the two reach."""
    from dataclasses import dataclass

    from draftfeed.broker.free_workers import FreeWorkers

    @dataclass(eq=False)
    class Record:
        peer: bytes
        order: int
        free_credits: int = 2
        last_assigned: int = -1
        version: int = 0
        removed: bool = False

    free = FreeWorkers()
    old = Record(b"w1", order=0)
    free.update(old)  # an entry at (2 free, never assigned): the best there can be
    old.free_credits = 1
    free.update(old)
    free.update(old)
    free.remove(old)
    new = Record(b"w1", order=1, free_credits=1, last_assigned=9)
    for _ in range(6):  # whatever version the new record reaches, the old record's entries stay stale
        free.update(new)
        assert free.pick() is new
