"""Updating a service's target weights in place (docs/versions.md): the client side of ``update_target``, for
``draftfeed target update`` and for an RL trainer's own process.

The broker tells every worker of the service below the new version to load the weights at ``weights`` (a path on the
workers' filesystem: a safetensors file, or a folder of them) and answers once each has said how it went.
"""

from __future__ import annotations

import time

import zmq

from draftfeed.schemas.errors import RemoteTargetError, RemoteTargetTimeout
from draftfeed.schemas.frames import pack, unpack
from draftfeed.schemas.messages import FRONTEND_OUTBOUND, ErrorReply, UpdateReport, UpdateTarget
from draftfeed.security.curve import PeerKeys, make_client


def update_target(
    broker: str, service: str, weights: str, target_version: int, timeout_s: float = 600.0, keys: PeerKeys | None = None
) -> UpdateReport:
    """Every worker of ``service`` at the broker's rank endpoint ``broker`` loads ``weights`` and serves them as
    ``target_version``; the report says how each went. Raises RemoteTargetError when the broker refuses (no such
    service), RemoteTargetTimeout when no report comes within ``timeout_s``."""
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if keys is not None:
        make_client(sock, keys.own, keys.broker)
    try:
        sock.connect(broker)
        deadline = time.monotonic() + timeout_s
        request = UpdateTarget(request_id=0, service=service, weights=weights, target_version=target_version)
        if not sock.poll(int(timeout_s * 1000), zmq.POLLOUT):
            raise RemoteTargetTimeout(f"no broker at {broker} took the update within {timeout_s:g} s: is it running there?")
        sock.send_multipart(pack(request))
        while (remaining := deadline - time.monotonic()) > 0:
            if not sock.poll(int(remaining * 1000)):
                break
            message, _ = unpack(sock.recv_multipart(), FRONTEND_OUTBOUND)
            if isinstance(message, UpdateReport) and message.request_id == request.request_id:
                return message
            if isinstance(message, ErrorReply):
                raise RemoteTargetError(f"the broker at {broker} refused the update: {message.message}")
        raise RemoteTargetTimeout(f"no update report from the broker at {broker} within {timeout_s:g} s (--timeout)")
    finally:
        sock.close(linger=0)
        context.term()


def format_report(report: UpdateReport) -> str:
    """One line a worker: its name, whether it took the update, the version it serves, and why not."""
    lines = []
    for result in report.workers:
        said = "updated" if result.ok else "kept"
        lines.append(f"{result.worker}: {said}, serves version {result.target_version}" + (f" ({result.message})" if result.message else ""))
    return "\n".join(lines) if lines else "no worker answered"
