"""The policy-free forwarder the cluster scenario measures the broker against, in the same run."""

from __future__ import annotations

import itertools
import json
import time
from collections import deque

import zmq

from draftfeed.schemas.frames import pack
from draftfeed.schemas.messages import (
    Heartbeat,
    Liveness,
    Registered,
    Welcome,
)
from draftfeed.schemas.protocol import SIGNATURE


def forward(heartbeat_s: float = 1.0) -> None:
    """A broker with no policy for the simulated cluster, in raw pyzmq: the baseline the broker's CPU per request is
    measured against in the same run. It answers hellos and registrations, hands each submit to a worker of its
    service with a free credit (in turn; a FIFO when none is free), takes each done's credit back, heartbeats every
    peer once per interval, and reads nothing of any message but its type and the few fields it routes by. It
    prints its endpoints, then serves until every peer it knew said bye."""
    context = zmq.Context()
    frontend, backend = context.socket(zmq.ROUTER), context.socket(zmq.ROUTER)
    for sock in (frontend, backend):
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
    host = "tcp://127.0.0.1"
    print(
        json.dumps({"frontend": f"{host}:{frontend.bind_to_random_port(host)}", "backend": f"{host}:{backend.bind_to_random_port(host)}"}), flush=True
    )
    welcome = pack(Welcome(broker="forwarder", instance="forwarder", services={}, liveness=_LIVENESS))[1]
    registered = pack(Registered(broker="forwarder", instance="forwarder", liveness=_LIVENESS))[1]
    beat = pack(Heartbeat(instance="forwarder"))[1]
    ranks: dict[bytes, tuple[str, bytes]] = {}  # rank -> its service, its part of a dispatch header
    workers: dict[bytes, str] = {}  # worker -> its service
    free: dict[str, deque[bytes]] = {}  # service -> one entry per free credit
    waiting: dict[str, deque[tuple[bytes, bytes, list]]] = {}  # service -> (rank, submit header, tensor frames)
    tickets = itertools.count()
    poller = zmq.Poller()
    poller.register(frontend, zmq.POLLIN)
    poller.register(backend, zmq.POLLIN)
    next_beat, seen_any = time.monotonic() + heartbeat_s, False

    def dispatch(worker: bytes, rank: bytes, header: bytes, tensors: list) -> None:
        head = b'{"type":"dispatch","ticket":%d,%s,"request":%s}' % (next(tickets), ranks[rank][1], header)
        backend.send_multipart([worker, SIGNATURE, head, *tensors])

    def on_rank(peer: bytes, kind: bytes, header: bytes, tensors: list) -> None:
        nonlocal seen_any
        if kind == b"submit":
            service = ranks[peer][0]
            if free.get(service):
                dispatch(free[service].popleft(), peer, header, tensors)
            else:
                waiting.setdefault(service, deque()).append((peer, header, tensors))
        elif kind == b"hello":
            fields = json.loads(header)
            names = (fields["rank"].encode(), fields["data_endpoint"].encode(), fields["service"].encode())
            ranks[peer] = (fields["service"], b'"rank":"%s","data_endpoint":"%s","service":"%s"' % names)
            frontend.send_multipart([peer, SIGNATURE, welcome])
            seen_any = True
        elif kind == b"bye":
            ranks.pop(peer, None)

    def on_worker(peer: bytes, kind: bytes, header: bytes) -> None:
        if kind == b"done":
            service = workers[peer]
            if waiting.get(service):
                dispatch(peer, *waiting[service].popleft())
            else:
                free.setdefault(service, deque()).append(peer)
        elif kind == b"register":
            fields = json.loads(header)
            service = workers[peer] = fields["service"]
            credits = free.setdefault(service, deque())
            credits.extend([peer] * fields["capacity"])
            backend.send_multipart([peer, SIGNATURE, registered])
            queued = waiting.get(service, deque())
            while queued and credits:
                dispatch(credits.popleft(), *queued.popleft())
        elif kind == b"bye":
            workers.pop(peer, None)

    while not seen_any or ranks or workers:
        for sock, _event in poller.poll(100):
            while sock.get(zmq.EVENTS) & zmq.POLLIN:
                peer, _signature, header, *tensors = sock.recv_multipart(copy=False)
                peer, header = peer.bytes, header.bytes
                kind = header[9 : header.find(b'"', 9)]
                if sock is frontend:
                    on_rank(peer, kind, header, tensors)
                else:
                    on_worker(peer, kind, header)
        if time.monotonic() >= next_beat:
            next_beat = time.monotonic() + heartbeat_s
            for rank in ranks:
                frontend.send_multipart([rank, SIGNATURE, beat])
            for worker in workers:
                backend.send_multipart([worker, SIGNATURE, beat])
    frontend.close(0)
    backend.close(0)
    context.term()


_LIVENESS = Liveness(heartbeat_interval_s=1.0, liveness=5)
