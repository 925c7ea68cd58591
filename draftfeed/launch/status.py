"""``draftfeed status``: ask a broker for its status document and print it."""

from __future__ import annotations

from typing import Any

import zmq

from draftfeed.schemas.errors import RemoteTargetTimeout
from draftfeed.schemas.frames import pack, unpack
from draftfeed.schemas.messages import FRONTEND_OUTBOUND, StatusQuery, StatusReply


def fetch_status(broker: str, timeout_s: float = 10.0) -> dict[str, Any]:
    """One status query on the broker's trainer endpoint; raises RemoteTargetTimeout if nobody answers."""
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(broker)
        sock.send_multipart(pack(StatusQuery(request_id=0)))
        deadline_ms = int(timeout_s * 1000)
        while sock.poll(deadline_ms):
            message, _ = unpack(sock.recv_multipart(), FRONTEND_OUTBOUND)
            if isinstance(message, StatusReply):
                return message.status
        raise RemoteTargetTimeout(f"no status from a broker at {broker} within {timeout_s:.0f} s; is it running, and is that its frontend?")
    finally:
        sock.close(linger=0)
        context.term()


def format_status(status: dict[str, Any]) -> str:
    lines = [f"broker {status['broker']} (up {status['uptime_s']:.0f} s)"]
    for name, service in status["services"].items():
        lines.append(f"service {name}: {service['queued']} queued, {len(service['workers'])} workers")
        for w in service["workers"]:
            lines.append(
                f"  worker {w['worker']} on {w['host']} pid {w['pid']} ({w['engine']}): "
                f"{w['in_flight']}/{w['capacity']} in flight, {w['served']} served, {w['failed']} failed, "
                f"seen {w['last_seen_s']:.1f} s ago"
            )
    for c in status["clients"]:
        lines.append(
            f"rank {c['client']} on {c['service']}: {c['outstanding']}/{c['window']} outstanding "
            f"(peak {c['peak_outstanding']}), {c['completed']}/{c['submitted']} done"
        )
    return "\n".join(lines)
