"""The prefetch bound: at most prefetch_depth batches of a rank queued or in flight anywhere, counted."""

from __future__ import annotations

import threading
from concurrent.futures import Future

import pytest
import torch
from conftest import add_service, make_batch, raw_peer, wait_until

from draftfeed import RemoteEagle3Target, RemoteTargetTimeout
from draftfeed.dataplane.frames.codec import pack_tensors
from draftfeed.producers.connection import Connection
from draftfeed.producers.prefetch import prefetch
from draftfeed.producers.requests import RequestKind
from draftfeed.schemas.frames import pack, unpack
from draftfeed.schemas.messages import FRONTEND_OUTBOUND, ErrorReply, Hello, StatusQuery, Submit, Welcome

pytestmark = pytest.mark.timeout(180)
SERVICE = "tiny-prefetch"


@pytest.fixture(scope="module")
def services(cluster, tiny_target):
    return add_service(cluster, tiny_target, SERVICE, workers=2)


@pytest.mark.parametrize("depth", [0, 1, 2, 4])
def test_in_flight_never_exceeds_the_depth_with_a_slow_training_loop(services, depth):
    batches = [make_batch(2, 64, 1000, seed=i) for i in range(24)]
    with RemoteEagle3Target(services.frontend, SERVICE, prefetch_depth=depth) as target:
        seen_in_flight = []
        for _batch, _supervision in target.iterate(batches):
            seen_in_flight.append(target.in_flight)
            torch.linalg.qr(torch.randn(256, 256))  # a training step: slower than handing over a batch

        def me() -> dict:
            return next(c for c in target.status()["ranks"] if c["rank"] == target.rank_id)

        # The last worker's done may reach the broker after its result reached this rank.
        status = wait_until(lambda: (lambda m: m if m["completed"] == len(batches) else None)(me()), what="the broker to count every batch done")
    window = max(depth, 1)
    assert target.peak_in_flight <= window
    assert max(seen_in_flight) <= depth
    assert status["peak_outstanding"] <= window, "the broker saw more of this rank's batches than its window"


def test_window_is_exact_when_nothing_is_served(services):
    """No worker serves this service, so nothing completes: the rank's window fills exactly and then blocks."""
    batch = make_batch(1, 4, 1000, seed=0)
    connection = Connection(services.frontend, "nobody-serves-this", window=3, task="eagle3")
    try:

        def submit(timeout_s: float):
            return connection.request(
                lambda rid, token: pack_tensors(Submit, batch, request_id=rid, kind="eagle3", token=token),
                lambda _reply, received: received,
                RequestKind.BATCH,
                timeout_s=timeout_s,
            )

        futures = [submit(1.0) for _ in range(3)]
        assert connection.in_flight == 3
        with pytest.raises(RemoteTargetTimeout, match="all 3 prefetch slots"):
            submit(0.5)
        assert not any(f.done() for f in futures)
        status = connection.request(lambda rid, _t: pack(StatusQuery(request_id=rid)), lambda r, _: r.status, RequestKind.STATUS).result(10)
    finally:
        connection.close()
    assert status["services"]["nobody-serves-this"]["queued"] == 3


def test_broker_pushes_back_on_a_rank_that_ignores_its_window(services):
    with raw_peer(services.frontend, b"greedy") as sock:
        sock.send_multipart(
            pack(Hello(rank="greedy", service="nobody-serves-this-either", data_endpoint="tcp://127.0.0.1:1", window=1, host="h", pid=1))
        )
        assert sock.poll(10_000)
        assert isinstance(unpack(sock.recv_multipart(), FRONTEND_OUTBOUND)[0], Welcome)
        tensors = make_batch(1, 4, 1000, seed=0)
        for request_id in range(3):
            sock.send_multipart(pack_tensors(Submit, tensors, request_id=request_id, kind="eagle3"), copy=False)
        assert sock.poll(10_000)
        reply, _ = unpack(sock.recv_multipart(), FRONTEND_OUTBOUND)
        assert isinstance(reply, ErrorReply) and reply.request_id == 2 and reply.code == "busy"
        assert "prefetch window is 1" in reply.message


def test_prefetch_yields_in_order_when_results_finish_out_of_order():
    outstanding: list[tuple[int, Future]] = []
    completion_order: list[int] = []

    def submit(item: int) -> Future:
        future: Future = Future()
        outstanding.append((item, future))
        return future

    def wait(future: Future) -> int:
        # Whatever is outstanding finishes newest first, as a fast worker overtaking a slow one would.
        while outstanding:
            item, f = outstanding.pop()
            completion_order.append(item)
            f.set_result(item * 10)
        return future.result(timeout=5)

    out = list(prefetch(range(6), submit, wait, depth=2))
    assert out == [(i, i * 10) for i in range(6)]
    assert completion_order != sorted(completion_order), "the test must complete out of order"


def test_prefetch_depth_zero_submits_only_when_asked():
    submitted: list[int] = []

    def submit(item: int) -> Future:
        submitted.append(item)
        future: Future = Future()
        future.set_result(item)
        return future

    iterator = prefetch(range(5), submit, lambda f: f.result(), depth=0)
    assert submitted == []
    next(iterator)
    assert submitted == [0]
    next(iterator)
    assert submitted == [0, 1]


def test_abandoned_iterator_cancels_what_it_holds():
    futures: list[Future] = []
    lock = threading.Lock()

    def submit(item: int) -> Future:
        future: Future = Future()
        with lock:
            futures.append(future)
        if item == 0:
            future.set_result(0)
        return future

    iterator = prefetch(range(10), submit, lambda f: f.result(timeout=5), depth=3)
    next(iterator)
    iterator.close()
    assert all(f.cancelled() for f in futures[1:])


@pytest.mark.parametrize("depth", [0, 1, 2])
def test_a_result_the_loop_dropped_is_freed_before_the_next_wait(depth):
    """prefetch() holds nothing it yielded: once the training loop lets go of a batch's supervision, it is freed
    before the loop waits for the next one (a frontier sample is gigabytes: held one wait longer, it is one sample
    more in memory)."""
    import gc
    import weakref

    class Supervision:
        pass

    alive: list[weakref.ref] = []
    seen_alive_while_waiting: list[int] = []

    def submit(batch: int) -> Future:
        future: Future = Future()
        future.set_result(Supervision())
        return future

    def wait(future: Future) -> Supervision:
        gc.collect()
        seen_alive_while_waiting.append(sum(ref() is not None for ref in alive))
        result = future.result()
        alive.append(weakref.ref(result))
        return result

    for _batch, supervision in prefetch(range(6), submit, wait, depth):
        del supervision
    # Each wait sees only what is still in flight (futures hold their results until waited for), never what was yielded.
    assert seen_alive_while_waiting == [0] * 6, seen_alive_while_waiting
