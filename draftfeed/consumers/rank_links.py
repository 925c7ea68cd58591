"""The worker's direct sockets to training ranks: one DEALER per rank data endpoint, opened on first use."""

from __future__ import annotations

import logging
from typing import Any

import zmq

from draftfeed.net import close_quietly

log = logging.getLogger("draftfeed.worker")


class RankLinks:
    """Sends supervision straight to each rank (one hop, zero-copy); a rank that stops reading costs a timeout, not the worker."""

    def __init__(self, context: zmq.Context, send_timeout_s: float) -> None:
        self._context = context
        self._send_timeout_ms = int(send_timeout_s * 1000)
        self._sockets: dict[str, zmq.Socket] = {}

    def send(self, endpoint: str, frames: list[Any]) -> bool:
        """Send one message; False if the rank did not take it within the send timeout."""
        sock = self._sockets.get(endpoint)
        if sock is None:
            sock = self._context.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDTIMEO, self._send_timeout_ms)
            sock.connect(endpoint)
            self._sockets[endpoint] = sock
        try:
            sock.send_multipart(frames, copy=False)
            return True
        except zmq.Again:
            log.error("worker: rank at %s took no message for %.0f s; dropping its link", endpoint, self._send_timeout_ms / 1000)
            self.drop(endpoint)
            return False

    def drop(self, endpoint: str) -> None:
        close_quietly(self._sockets.pop(endpoint, None))

    def close(self) -> None:
        for endpoint in list(self._sockets):
            self.drop(endpoint)
