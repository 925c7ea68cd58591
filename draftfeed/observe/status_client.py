"""A client of the broker's status query (for `draftfeed status`, the bench and the tests): the status document, page by page, and its table.

A page holds the totals and every service's summary, and as many workers and ranks as fit one reply
(broker/status.py); ``fetch_status`` asks for the pages in turn on one connection and puts the document together,
so it works the same against a broker with ten peers or ten thousand. People see a summary first: the table lists
workers and ranks when there are few (``LIST_AT_MOST``), and says how to list them otherwise.
"""

from __future__ import annotations

import time
from typing import Any

import zmq

from draftfeed.schemas.errors import RemoteTargetTimeout
from draftfeed.schemas.frames import pack, unpack
from draftfeed.schemas.messages import FRONTEND_OUTBOUND, ErrorReply, StatusQuery, StatusReply
from draftfeed.security.curve import PeerKeys, make_client
from draftfeed.security.handshake import HandshakeWatch

LIST_AT_MOST = 64  # the table lists workers and ranks when there are at most this many of each


def fetch_status(broker: str, timeout_s: float = 10.0, keys: PeerKeys | None = None, *, pairs: bool = True, summary: bool = False) -> dict[str, Any]:
    """The broker's status document, asked page by page on its rank endpoint (with a rank's ``keys`` for a secure
    broker): every worker (with its ``pairs``) and every rank, or with ``summary`` the totals and services only.
    Raises RemoteTargetTimeout if nobody answers within ``timeout_s`` (for the whole document), saying why when the
    handshake tells (a secure broker, a refused key)."""
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if keys is not None:
        make_client(sock, keys.own, keys.broker)
    watch = HandshakeWatch(sock, broker, "rank", secure=keys is not None)
    try:
        sock.connect(broker)
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(watch.monitor, zmq.POLLIN)
        deadline = time.monotonic() + timeout_s
        query = StatusQuery(request_id=0, pairs=pairs, summary=summary)
        document = _ask(sock, poller, watch, query, deadline, broker, timeout_s)
        while (page := document["page"])["workers_next"] is not None or page["ranks_next"] is not None:
            query = StatusQuery(request_id=query.request_id + 1, workers_from=page["workers_next"], ranks_from=page["ranks_next"], pairs=pairs)
            _merge(document, _ask(sock, poller, watch, query, deadline, broker, timeout_s))
        return document
    finally:
        watch.close()
        sock.close(linger=0)
        context.term()


def _ask(
    sock: zmq.Socket, poller: zmq.Poller, watch: HandshakeWatch, query: StatusQuery, deadline: float, broker: str, timeout_s: float
) -> dict[str, Any]:
    """One page: the reply to ``query``, before ``deadline``."""
    _send(sock, watch, pack(query), deadline, broker)
    while (remaining := deadline - time.monotonic()) > 0:
        events = dict(poller.poll(int(remaining * 1000)))
        if watch.monitor in events:
            watch.read()
            if watch.verdict is not None:
                raise RemoteTargetTimeout(f"no status from the broker at {broker}: {watch.verdict}")
        if sock in events:
            message, _ = unpack(sock.recv_multipart(), FRONTEND_OUTBOUND)
            if isinstance(message, StatusReply) and message.request_id == query.request_id:
                return message.status
            if isinstance(message, ErrorReply):
                raise RemoteTargetTimeout(f"the broker at {broker} answered: {message.message}")
    raise RemoteTargetTimeout(
        f"no status from a broker at {broker} within {timeout_s:g} s (--timeout): is it running, and is that its rank port (--frontend)?"
    )


def _send(sock: zmq.Socket, watch: HandshakeWatch, frames: list[Any], deadline: float, broker: str) -> None:
    """Send the query once the socket takes it: a connection whose handshake failed leaves it no pipe for a moment (a
    send raises Again), and the handshake watch then says why."""
    while True:
        try:
            sock.send_multipart(frames, flags=zmq.NOBLOCK)
            return
        except zmq.Again:
            if watch.monitor.poll(50):
                watch.read()
            if watch.verdict is not None:
                raise RemoteTargetTimeout(f"no status from the broker at {broker}: {watch.verdict}") from None
            if time.monotonic() >= deadline:
                raise RemoteTargetTimeout(f"no broker at {broker} took the status query (--timeout): is it running there?") from None


def _merge(document: dict[str, Any], page: dict[str, Any]) -> None:
    """A later page's workers and ranks added to the first page's document (its totals are the first page's)."""
    for name, service in page["services"].items():
        if name in document["services"]:
            document["services"][name]["workers"].extend(service["workers"])
    document["ranks"].extend(page["ranks"])
    document["page"] = {**page["page"], "workers_from": document["page"]["workers_from"], "ranks_from": document["page"]["ranks_from"]}


def ready_workers(status: dict[str, Any], service: str) -> int:
    """The workers of ``service`` that take work now (registered, not draining)."""
    return status["services"].get(service, {}).get("ready_workers", 0)


def fetch_for_people(broker: str, timeout_s: float, keys: PeerKeys | None, *, everything: bool, pairs: bool) -> dict[str, Any]:
    """What ``draftfeed status`` shows: the summary, and the workers (with their pairs) and ranks too when there are
    few of them; ``everything`` (``--list``, ``--json``) lists them all, ``pairs`` with their pairs."""
    status = fetch_status(broker, timeout_s, keys, summary=True)
    few = status["worker_count"] <= LIST_AT_MOST and status["rank_count"] <= LIST_AT_MOST
    if everything or pairs or few:
        status = fetch_status(broker, timeout_s, keys, pairs=pairs or few)
    return status


def format_status(status: dict[str, Any]) -> str:
    """A table for people; ``--json`` gives scripts the same numbers. Workers and ranks are listed when the document
    holds them (not a summary)."""
    state = " (draining)" if status.get("draining") else ""
    lines = [
        f"broker {status['broker']} instance {status['instance']}{state}, up {status['uptime_s']:.0f} s, "
        f"liveness period {status['liveness_s']:.1f} s; " + ", ".join(f"{k} {v}" for k, v in status["counters"].items())
    ]
    if status.get("requeues"):
        lines.append("requests back in the queue, by cause: " + ", ".join(f"{k} {v}" for k, v in sorted(status["requeues"].items())))
    workers_total, ranks_total = status.get("worker_count", 0), status.get("rank_count", 0)
    lines.append(f"{workers_total} workers, {ranks_total} ranks")
    listed = not status.get("page", {}).get("summary", False)
    for name, service in status["services"].items():
        lines.append(
            f"service {name}: {service['queued']} queued, {service['requests_per_s']:.1f} requests/s over the last 10 s, "
            f"{service['worker_count']} workers ({service['ready_workers']} ready, {service['in_flight']} requests at them), "
            f"{service['rank_count']} ranks"
        )
        for w in service["workers"] if listed else []:
            lines.append(
                f"  worker {w['worker']:<28} host {w['host']} pid {w['pid']} {w['engine']:<8}{_spread(w)} {w['state']:<8} "
                f"in flight {w['in_flight']}/{w['capacity']}  served {w['served']} ({w['batches']} batches)  failed {w['failed']}  handed back {w['handed_back']}  "
                f"rank links {w['rank_links']}  heartbeat {w['last_heartbeat_s']:.1f} s ago  pairs {w['pair_count']}{_planes(w)}"
            )
            for pair in w.get("pairs", []):
                generation = "" if pair["generation"] is None else f" generation {pair['generation']}"
                lines.append(
                    f"    to rank {pair['rank']}: {pair['plane']} ({pair['state']}{generation}), {pair['sent_over_pair']} sent on the group, "
                    f"{pair['fallbacks']} fell back to frames; {pair['reason']}"
                )
            if w.get("pairs_omitted"):
                lines.append(f"    and {w['pairs_omitted']} pairs more (over one page)")
    if not listed:
        lines.append(f"more than {LIST_AT_MOST} workers or ranks: --list shows each of them, --json the whole document")
    for c in status["ranks"] if listed else []:
        lines.append(
            f"rank {c['rank']:<30} service {c['service']}: queued {c['queued']}, outstanding {c['outstanding']}/{c['window']} "
            f"(peak {c['peak_outstanding']}), done {c['completed']}/{c['submitted']}, oldest request {c['oldest_request_s']:.1f} s, "
            f"heartbeat {c['last_heartbeat_s']:.1f} s ago"
        )
    return "\n".join(lines)


def _planes(worker: dict[str, Any]) -> str:
    """`` (frames/frames 3, nccl/ready 1)``: its pairs by plane and state, as the broker has heard of them."""
    planes = worker.get("planes") or {}
    return " (" + ", ".join(f"{name} {count}" for name, count in sorted(planes.items())) + ")" if planes else ""


def _spread(worker: dict[str, Any]) -> str:
    """`` tensor-parallel 2 on cuda:0,cuda:1`` for a worker over several devices, else nothing."""
    degree = worker.get("tensor_parallel", 1)
    return f" tensor-parallel {degree} on {','.join(worker.get('devices', []))}" if degree > 1 else ""
