"""The worker's direct sockets to training ranks: one DEALER per rank data data_endpoint, opened on first use."""

from __future__ import annotations

import enum
import logging
from collections import OrderedDict
from typing import Any

import zmq

from draftfeed.schemas.protocol import DEFAULT_MAX_REQUEST_BYTES
from draftfeed.security.curve import PeerKeys, make_client

_FORGOTTEN_KEPT = 4096
log = logging.getLogger("draftfeed.worker")


class SendResult(enum.Enum):
    """What became of an answer for a rank."""

    SENT = "sent"
    BLOCKED = "blocked"  # its link is full or not connected yet: try again (never the end of a delivery)
    FORGOTTEN = "forgotten"  # the broker reported the rank gone
    UNREACHABLE = "unreachable"  # its data socket never answered within the connect timeout
    STALLED = "stalled"  # it took nothing for the send timeout


class RankLinks:
    """Sends supervision straight to each rank (one hop, zero-copy).

    Sends never block here: messages queue only on a completed connection (ZMQ_IMMEDIATE), up to a
    small high-water mark, and the worker decides how long to keep trying (see AnswerDelivery._send). Ranks
    the broker reported gone are remembered, so a late answer for one opens no socket to a dead data_endpoint.
    """

    def __init__(self, context: zmq.Context, hwm: int = 4, keys: PeerKeys | None = None, max_frame_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> None:
        """``max_frame_bytes``: the largest frame a rank may send back (libzmq drops a rank that sends more, before
        allocating it); a rank only sends small control messages on these links."""
        self._context = context
        self._hwm = hwm
        self._max_frame_bytes = max_frame_bytes
        self._keys = keys
        self._server_keys: dict[str, str | None] = {}  # data_endpoint -> the rank's public key (secure brokers send it)
        self._sockets: dict[str, zmq.Socket] = {}
        self._reached: set[str] = set()
        self._forgotten: OrderedDict[str, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._sockets)

    def socket(self, data_endpoint: str) -> zmq.Socket:
        sock = self._sockets.get(data_endpoint)
        if sock is None:
            sock = self._context.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.IMMEDIATE, 1)
            sock.setsockopt(zmq.SNDHWM, self._hwm)
            sock.setsockopt(zmq.MAXMSGSIZE, self._max_frame_bytes)
            if self._keys is not None:
                server = self._server_keys.get(data_endpoint)
                if server is None:
                    # Never plaintext from a secure worker: no key, no link (the send stays blocked and times out).
                    raise ValueError(f"no public key for rank data endpoint {data_endpoint}: is the broker running with --secure?")
                make_client(sock, self._keys.own, server.encode())
            sock.connect(data_endpoint)
            self._sockets[data_endpoint] = sock
        return sock

    def try_send(self, data_endpoint: str, frames: list[Any]) -> SendResult:
        """One non-blocking attempt: SENT, BLOCKED (its pipe is full, or not connected yet) or FORGOTTEN."""
        if data_endpoint in self._forgotten:
            return SendResult.FORGOTTEN
        try:
            sock = self.socket(data_endpoint)
        except ValueError as exc:
            log.error("%s; not sending to it", exc)
            return SendResult.FORGOTTEN
        try:
            sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
            self._reached.add(data_endpoint)
            return SendResult.SENT
        except zmq.Again:
            return SendResult.BLOCKED

    def incoming(self) -> list[tuple[str, list[Any]]]:
        """Messages ranks sent back on these links (data-plane control), without blocking."""
        received = []
        for data_endpoint, sock in list(self._sockets.items()):
            while True:
                try:
                    received.append((data_endpoint, sock.recv_multipart(zmq.NOBLOCK, copy=False)))
                except zmq.Again:
                    break
        return received

    def ever_sent(self, data_endpoint: str) -> bool:
        """Whether a message ever went out on the current link to this data_endpoint."""
        return data_endpoint in self._reached

    def remember(self, data_endpoint: str, key: str | None = None) -> None:
        """The broker dispatches for this rank (again, if it came back after being declared gone); ``key`` is
        the rank's public key, which its data socket must prove."""
        self._forgotten.pop(data_endpoint, None)
        if self._server_keys.get(data_endpoint) != key:
            self._server_keys[data_endpoint] = key
            self.drop(data_endpoint)  # a new rank on a reused data_endpoint: reconnect with its key

    def forget(self, data_endpoint: str) -> None:
        """The rank is gone: close its link and send it nothing more."""
        self.drop(data_endpoint)
        self._forgotten[data_endpoint] = None
        while len(self._forgotten) > _FORGOTTEN_KEPT:
            self._forgotten.popitem(last=False)

    def drop(self, data_endpoint: str, linger_s: float = 0.0) -> None:
        """Close the link; what it still holds for its rank may go out for ``linger_s`` more, while the context
        terminates."""
        self._reached.discard(data_endpoint)
        sock = self._sockets.pop(data_endpoint, None)
        if sock is not None and not sock.closed:
            sock.close(linger=int(linger_s * 1000))

    def close(self, linger_s: float = 0.0) -> None:
        """Close every link (``linger_s``: as for drop; the last pieces of an answer reported done may still be held)."""
        for data_endpoint in list(self._sockets):
            self.drop(data_endpoint, linger_s)
