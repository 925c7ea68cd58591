"""The inproc pipes between a process's threads (a worker's compute loop and broker link, a rank's callers and IO thread)."""

from __future__ import annotations

import threading
import uuid

import pytest
import zmq

from draftfeed.net import send_to_thread

pytestmark = pytest.mark.timeout(30)


def test_a_send_to_a_link_that_has_ended_returns_at_once():
    """A link that ends leaves the compute loop's end of the pipe without a peer (always when it ends before
    connecting its end, as a link that fails while setting up; sometimes when it connects and closes before the compute
    loop has sent anything, as a link the broker refuses at once). A plain PAIR send then blocks forever: a CI run
    waited 120 s for a refused worker that never exited. The send returns False instead."""
    context = zmq.Context()
    pipe = context.socket(zmq.PAIR)
    pipe.setsockopt(zmq.LINGER, 0)
    pipe.bind(f"inproc://test-link-{uuid.uuid4().hex}")
    link = threading.Thread(target=lambda: None, daemon=True)  # a link that failed before it connected its end
    link.start()
    try:
        link.join(10)
        assert send_to_thread(pipe, [b"stop"], link) is False
    finally:
        pipe.close()
        context.term()


def test_a_send_to_a_live_link_arrives():
    context = zmq.Context()
    endpoint = f"inproc://test-link-{uuid.uuid4().hex}"
    pipe = context.socket(zmq.PAIR)
    pipe.setsockopt(zmq.LINGER, 0)
    pipe.bind(endpoint)
    connected, received = threading.Event(), []

    def link_that_reads_once() -> None:
        end = context.socket(zmq.PAIR)
        end.setsockopt(zmq.LINGER, 0)
        end.connect(endpoint)
        connected.set()
        if end.poll(10_000):
            received.append(end.recv_multipart())
        end.close()

    link = threading.Thread(target=link_that_reads_once, daemon=True)
    link.start()
    try:
        assert connected.wait(10)
        assert send_to_thread(pipe, [b"done", b"7"], link) is True
        link.join(15)
        assert received == [[b"done", b"7"]]
    finally:
        pipe.close()
        context.term()
