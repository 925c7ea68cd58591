"""Socket helpers: endpoints, binding to a free port, closing without lingering."""

from __future__ import annotations

import random
import socket
import threading
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import zmq


def bind(sock: zmq.Socket, endpoint: str) -> str:
    """Bind and return the endpoint actually bound (``tcp://host:*`` picks a free port)."""
    sock.bind(endpoint)
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


def local_address_towards(endpoint: str) -> str:
    """The IP of this host's interface that routes to ``endpoint``'s host (no packet is sent).

    A rank advertises its data socket on this address, so that a worker that reaches the broker
    reaches the rank the same way.
    """
    host = urlsplit(endpoint.replace("tcp://", "tcp://", 1)).hostname or "127.0.0.1"
    if host in ("*", "localhost") or host.startswith("127."):
        return "127.0.0.1"
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((host, 9))
        return probe.getsockname()[0]


_LOWEST_CHOSEN_PORT = 10_000


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now, for a server that is told its port. Drawn at random below the kernel's
    ephemeral range, from which every connection's own port and every bind to port 0 (``tcp://host:*``) are taken:
    those cannot take it before it is bound again; another ``free_port`` caller can, rarely."""
    low, high = _LOWEST_CHOSEN_PORT, _ephemeral_range()[0]
    for _ in range(64):
        port = random.randrange(low, high) if high > low + 1000 else 0
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue  # taken: draw again
            return sock.getsockname()[1]
    raise OSError(f"no free TCP port on {host} between {low} and {high} after 64 draws")


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = (int(part) for part in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32_768, 60_999  # Linux's default


def is_loopback(endpoint: str) -> bool:
    """Whether a tcp endpoint is reachable from this machine only (ipc and inproc are local too)."""
    if not endpoint.startswith("tcp://"):
        return True
    host = urlsplit(endpoint).hostname or ""
    return host == "localhost" or host.startswith("127.") or host == "::1"


_NOBLOCK = int(zmq.NOBLOCK)


def recv_routed(sock: zmq.Socket) -> tuple[bytes, list[zmq.Frame]]:
    """One whole message from a ROUTER without blocking (zmq.Again if none waits): the sender's identity as bytes,
    then the frames it sent, uncopied. Four times cheaper than ``recv_multipart(NOBLOCK, copy=False)`` for the small
    messages a broker routes, which spends its time on flag arithmetic: the rest of a multipart message is there once
    its first frame is, and a ROUTER's identity frame always has a frame after it (copied: for a few bytes a copy
    costs a third of a zmq.Frame)."""
    peer = sock.recv(_NOBLOCK)
    frames = [sock.recv(_NOBLOCK, copy=False)]
    while frames[-1].more:
        frames.append(sock.recv(_NOBLOCK, copy=False))
    return peer, frames


def send_to_thread(pipe: zmq.Socket, frames: list[Any], thread: threading.Thread) -> bool:
    """Send on an inproc PAIR pipe to the thread that owns its other end; False, at once, if that thread has ended.

    A PAIR socket without a peer blocks a plain send forever, and a thread that ends before it connects its end (or
    connects and closes it before this end has sent anything) leaves this end without one."""
    while True:
        try:
            pipe.send_multipart(frames, flags=zmq.DONTWAIT, copy=False)
            return True
        except zmq.Again:
            if not thread.is_alive():
                return False
            pipe.poll(100, zmq.POLLOUT)


def host_identity() -> str:
    return socket.gethostname()


def close_quietly(*sockets: zmq.Socket | None) -> None:
    for sock in sockets:
        if sock is not None and not sock.closed:
            sock.close(linger=0)
