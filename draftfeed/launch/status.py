"""``draftfeed status``: ask a broker for its status document and print it."""

from __future__ import annotations

import time
from typing import Any

import zmq

from draftfeed.schemas.errors import RemoteTargetTimeout
from draftfeed.schemas.frames import pack, unpack
from draftfeed.schemas.messages import FRONTEND_OUTBOUND, ErrorReply, StatusQuery, StatusReply
from draftfeed.security.curve import PeerKeys, make_client
from draftfeed.security.handshake import HandshakeWatch


def fetch_status(broker: str, timeout_s: float = 10.0, keys: PeerKeys | None = None) -> dict[str, Any]:
    """One status query on the broker's rank endpoint (with a rank's ``keys`` for a secure broker); raises
    RemoteTargetTimeout if nobody answers, saying why when the handshake tells (a secure broker, a refused key)."""
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if keys is not None:
        make_client(sock, keys.own, keys.broker)
    watch = HandshakeWatch(sock, broker, "rank", secure=keys is not None)
    try:
        sock.connect(broker)
        sock.send_multipart(pack(StatusQuery(request_id=0)), flags=zmq.NOBLOCK)
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(watch.monitor, zmq.POLLIN)
        deadline = time.monotonic() + timeout_s
        while (remaining := deadline - time.monotonic()) > 0:
            events = dict(poller.poll(int(remaining * 1000)))
            if watch.monitor in events:
                watch.read()
                if watch.verdict is not None:
                    raise RemoteTargetTimeout(f"no status from the broker at {broker}: {watch.verdict}")
            if sock in events:
                message, _ = unpack(sock.recv_multipart(), FRONTEND_OUTBOUND)
                if isinstance(message, StatusReply):
                    return message.status
                if isinstance(message, ErrorReply):
                    raise RemoteTargetTimeout(f"the broker at {broker} answered: {message.message}")
        raise RemoteTargetTimeout(
            f"no status from a broker at {broker} within {timeout_s:g} s (--timeout): is it running, and is that its rank port (--frontend)?"
        )
    finally:
        watch.close()
        sock.close(linger=0)
        context.term()


def ready_workers(status: dict[str, Any], service: str) -> int:
    """The workers of ``service`` that take work now (registered, not draining)."""
    workers = status["services"].get(service, {}).get("workers", [])
    return sum(1 for worker in workers if worker["state"] != "draining")


def format_status(status: dict[str, Any]) -> str:
    """A table for people; ``--json`` gives scripts the same numbers."""
    state = " (draining)" if status.get("draining") else ""
    lines = [
        f"broker {status['broker']} instance {status['instance']}{state}, up {status['uptime_s']:.0f} s, "
        f"liveness period {status['liveness_s']:.1f} s; " + ", ".join(f"{k} {v}" for k, v in status["counters"].items())
    ]
    if status.get("requeues"):
        lines.append("requests back in the queue, by cause: " + ", ".join(f"{k} {v}" for k, v in sorted(status["requeues"].items())))
    for name, service in status["services"].items():
        lines.append(
            f"service {name}: {service['queued']} queued, {service['requests_per_s']:.1f} requests/s over the last 10 s, {len(service['workers'])} workers"
        )
        for w in service["workers"]:
            lines.append(
                f"  worker {w['worker']:<28} host {w['host']} pid {w['pid']} {w['engine']:<8}{_spread(w)} {w['state']:<8} "
                f"in flight {w['in_flight']}/{w['capacity']}  served {w['served']} ({w['batches']} batches)  failed {w['failed']}  handed back {w['handed_back']}  "
                f"rank links {w['rank_links']}  heartbeat {w['last_heartbeat_s']:.1f} s ago"
            )
            for pair in w.get("pairs", []):
                generation = "" if pair["generation"] is None else f" generation {pair['generation']}"
                lines.append(
                    f"    to rank {pair['rank']}: {pair['plane']} ({pair['state']}{generation}), {pair['sent_over_pair']} sent on the group, "
                    f"{pair['fallbacks']} fell back to frames; {pair['reason']}"
                )
    for c in status["ranks"]:
        lines.append(
            f"rank {c['rank']:<30} service {c['service']}: queued {c['queued']}, outstanding {c['outstanding']}/{c['window']} "
            f"(peak {c['peak_outstanding']}), done {c['completed']}/{c['submitted']}, heartbeat {c['last_heartbeat_s']:.1f} s ago"
        )
    return "\n".join(lines)


def _spread(worker: dict[str, Any]) -> str:
    """`` tensor-parallel 2 on cuda:0,cuda:1`` for a worker over several devices, else nothing."""
    degree = worker.get("tensor_parallel", 1)
    return f" tensor-parallel {degree} on {','.join(worker.get('devices', []))}" if degree > 1 else ""
