"""A rank's IO thread only moves frames: the caller's ``finish`` runs on the thread that takes the result.

The unit tests drive the request table without sockets; the last one runs a real broker and worker, with a
``finish`` slower than the liveness period, and checks that it costs the rank nothing."""

from __future__ import annotations

import threading
import time
from concurrent.futures import wait

import pytest
from conftest import add_service, assert_supervision_equal, make_batch, reference_eagle3

from draftfeed import RemoteEagle3Target
from draftfeed.producers.requests import RequestKind, RequestTable
from draftfeed.schemas.errors import RemoteTargetError

pytestmark = pytest.mark.timeout(120)


def _resolve_on_another_thread(table: RequestTable, request_id: int, **reply) -> None:
    """Resolve as the IO thread would: from a thread of its own."""
    io_thread = threading.Thread(target=lambda: table.resolve(request_id, **reply))
    io_thread.start()
    io_thread.join(10)


def test_finish_runs_once_on_the_thread_that_takes_the_result():
    table = RequestTable(window=1)
    ran_on: list[int] = []

    def finish(header, tensors):
        ran_on.append(threading.get_ident())
        return {"header": header, **tensors}

    request_id, waiter = table.add(finish, RequestKind.BATCH)
    _resolve_on_another_thread(table, request_id, header="h", tensors={"t": 1})
    assert ran_on == []  # resolving ran nothing of the caller's
    assert wait([waiter.future], timeout=0).done == {waiter.future}  # done as soon as the reply is in
    value = waiter.future.result(0)
    assert value == {"header": "h", "t": 1} and waiter.future.result(0) is value
    assert ran_on == [threading.get_ident()]


def test_a_finish_that_fails_fails_the_request_with_why_wherever_it_is_taken():
    table = RequestTable(window=1)
    request_id, waiter = table.add(lambda header, tensors: tensors["missing"], RequestKind.BATCH)
    _resolve_on_another_thread(table, request_id, header="h", tensors={})
    error = waiter.future.exception(0)
    assert isinstance(error, RemoteTargetError) and f"reply to request {request_id} is unusable" in str(error)
    with pytest.raises(RemoteTargetError, match="unusable: 'missing'"):
        waiter.future.result(0)


def test_an_error_from_the_pipeline_is_raised_as_it_came_and_finish_never_runs():
    table = RequestTable(window=1)
    request_id, waiter = table.add(lambda *_: pytest.fail("finish ran for a failed request"), RequestKind.BATCH)
    _resolve_on_another_thread(table, request_id, error=RemoteTargetError("the worker could not serve it"))
    with pytest.raises(RemoteTargetError, match="could not serve it"):
        waiter.future.result(0)


SLOW_FINISH_S = 2.5  # longer than the liveness period of FAST_LIVENESS: 0.2 s heartbeats x 8 = 1.6 s


class SlowFinishEagle3Target(RemoteEagle3Target):
    """A rank whose turning a reply into supervision takes longer than the liveness period (as the compact form's
    lm_head matmul on a large vocabulary can), and which notes the thread that did it."""

    finished_on: list[int]

    def _from_wire(self, received, own):
        self.finished_on.append(threading.get_ident())
        time.sleep(SLOW_FINISH_S)  # stands for work on the taker's thread
        return super()._from_wire(received, own)


def test_a_finish_longer_than_the_liveness_window_costs_the_rank_nothing(fast_cluster, tiny_target, tiny_model):
    add_service(fast_cluster, tiny_target, "slow-finish")
    batches = [make_batch(2, 24, 1000, seed=seed) for seed in range(3)]
    with SlowFinishEagle3Target(fast_cluster.frontend, "slow-finish", prefetch_depth=2) as target:
        target.finished_on = []
        got = list(target.iterate(batches))
        stats = target.connection_stats
        status = target.status()
    for (_batch, supervision), batch in zip(got, batches, strict=True):
        assert_supervision_equal(supervision, reference_eagle3(tiny_model, batch, [1, 3, 4]))
    assert target.finished_on == [threading.get_ident()] * 3  # on this (the caller's) thread, never the IO thread
    assert stats.resyncs == 0 and stats.duplicates_dropped == 0, f"the rank was forgotten or asked again: {stats}"
    assert status["counters"]["ranks_expired"] == 0 and status["counters"]["requeued"] == 0, status["counters"]
