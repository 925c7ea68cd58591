"""Measuring ends that run in their own processes, so each can get its own environment (malloc tunables).

``python -m draftfeed.bench.probes raw-send ENDPOINT BYTES COUNT``: a raw pyzmq DEALER sending COUNT
messages of BYTES, zero-copy from one buffer (the baseline's sender).
``python -m draftfeed.bench.probes raw-recv BYTES COUNT``: binds a ROUTER, prints its endpoint, receives
COUNT messages and prints the rate.
``python -m draftfeed.bench.probes rank FRONTEND SERVICE TOKENS COUNT DEPTH``: a training rank receiving
COUNT batches of synthetic supervision through the pipeline and printing the rate.
``rank ... DEPTH DATA_PLANE`` asks for that data plane (default auto).
``raw-gloo-recv BYTES COUNT`` hosts a pair group's store, prints its port, receives COUNT tensors of BYTES
over gloo and prints the rate; ``raw-gloo-send PORT BYTES COUNT`` joins and sends (the pair plane's baseline).
``raw-nixl-recv FILE BYTES COUNT`` registers BYTES with a NIXL agent, writes its metadata to FILE and prints the
address, then waits for COUNT + 1 writes' notifications; ``raw-nixl-send FILE ADDRESS BYTES COUNT`` loads that metadata and
writes BYTES into it COUNT + 1 times, one after another, each until NIXL reports it done (the nixl plane's baseline;
the rate is the sender's, once each write has landed).
``raw-worker BACKEND COUNT`` and ``raw-rank FRONTEND COUNT WINDOW``: minimal peers in raw pyzmq around a real
broker, so that the broker's own routing rate shows.
``raw-forwarder COUNT``: a broker with no policy in raw pyzmq (it prints its endpoints, then forwards each submit
to the one worker as a dispatch and counts COUNT dones): the most any Python broker of these messages can route.
Each prints one JSON line.
"""

from __future__ import annotations

import json
import re
import resource
import sys
import time
from collections.abc import Iterator

import zmq

from draftfeed.schemas.protocol import SIGNATURE


def _faults() -> int:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_minflt + usage.ru_majflt


def raw_send(endpoint: str, nbytes: int, count: int) -> None:
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, -1)
    sock.connect(endpoint)
    payload = memoryview(bytearray(nbytes))
    for _ in range(count + 1):  # one warm-up message
        sock.send_multipart([b"x", payload], copy=False)
    sock.close()
    context.term()


def raw_recv(nbytes: int, count: int) -> None:
    context = zmq.Context()
    sock = context.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    print(json.dumps({"endpoint": f"tcp://127.0.0.1:{port}"}), flush=True)
    sock.recv_multipart(copy=False)  # warm-up
    faults = _faults()
    started = time.perf_counter()
    for _ in range(count):
        frames = sock.recv_multipart(copy=False)
        assert frames[-1].buffer.nbytes == nbytes
        del frames
    elapsed = time.perf_counter() - started
    print(json.dumps({"bytes_per_s": nbytes * count / elapsed, "seconds": elapsed, "faults_per_msg": (_faults() - faults) / count}), flush=True)
    sock.close(0)
    context.term()


def rank(frontend: str, service: str, tokens: int, count: int, depth: int, data_plane: str = "auto") -> None:
    import torch

    from draftfeed import RemoteEagle3Target

    batch = {
        "input_ids": torch.zeros(1, tokens, dtype=torch.int64),
        "attention_mask": torch.ones(1, tokens, dtype=torch.int64),
        "loss_mask": torch.ones(1, tokens, dtype=torch.int64),
    }
    with RemoteEagle3Target(frontend, service, prefetch_depth=depth, data_plane=data_plane) as target:
        target.model_info()
        nbytes = target.generate_batch(**batch).nbytes  # a pair group or nixl pair is built meanwhile
        # Warm-up in the pattern measured (depth in flight), so that what a steady run reuses (nixl receive slots,
        # allocator pages) exists before the clock starts, as the raw probes' one warm-up message makes it for them.
        # The last two answers are held meanwhile, so that the pool makes every nixl slot a steady run can need: one
        # the loop still holds while the worker asks for a slot for the answer after next. Else a run makes that slot
        # now and then mid-run (a 312.5 MB slot took 0.8-1.5 s the first time on this VM).
        held: list = []
        for _batch, supervision in target.iterate(batch for _ in range(depth + 3)):
            held = [*held[-1:], supervision]
        del held, supervision
        faults = _faults()
        started = time.perf_counter()
        for _batch, supervision in target.iterate(batch for _ in range(count)):
            del supervision
        elapsed = time.perf_counter() - started
        over_pair = target.connection_stats.received_over_pair
        over_nixl = target.connection_stats.received_over_nixl
    print(
        json.dumps(
            {
                "bytes_per_s": nbytes * count / elapsed,
                "seconds": elapsed,
                "faults_per_msg": (_faults() - faults) / count,
                "bytes": nbytes,
                "received_over_pair": over_pair,
                "received_over_nixl": over_nixl,
            }
        ),
        flush=True,
    )


def raw_gloo_recv(nbytes: int, count: int) -> None:
    from draftfeed.dataplane.pair_group.transport import RECEIVER, PairGroup, host_store
    from draftfeed.schemas.messages import TensorSpec

    store = host_store()
    print(json.dumps({"port": store.port}), flush=True)
    group = PairGroup(store, RECEIVER, "gloo")
    specs = [TensorSpec(name="payload", dtype="uint8", shape=[nbytes])]
    group.receive(specs)  # warm-up
    started = time.perf_counter()
    for _ in range(count):
        group.receive(specs)
    elapsed = time.perf_counter() - started
    print(json.dumps({"bytes_per_s": nbytes * count / elapsed, "seconds": elapsed}), flush=True)
    group.close()


def raw_gloo_send(port: int, nbytes: int, count: int) -> None:
    import torch

    from draftfeed.dataplane.pair_group.transport import SENDER, PairGroup, join_store

    group = PairGroup(join_store("127.0.0.1", port), SENDER, "gloo")
    payload = {"payload": torch.zeros(nbytes, dtype=torch.uint8)}
    for _ in range(count + 1):
        group.send(payload)
    group.close()


def raw_nixl_recv(path: str, nbytes: int, count: int) -> None:
    from draftfeed.dataplane.nixl.memory import Region, host_memory
    from draftfeed.dataplane.nixl.transport import NixlAgent

    agent = NixlAgent("raw-nixl-recv")
    buffer = host_memory(nbytes)  # aligned as the rank's receive slots are
    region = Region(buffer.ctypes.data, nbytes)
    agent.register(region)
    with open(path, "wb") as out:
        out.write(agent.metadata())
    print(json.dumps({"address": region.address}), flush=True)
    seen = 0
    deadline = time.monotonic() + 600
    while seen < count + 1 and time.monotonic() < deadline:
        seen += sum(len(messages) for messages in agent.notifications().values())
        time.sleep(1e-4)  # polling for notifications, as the rank's IO loop does
    print(json.dumps({"notifications": seen}), flush=True)
    agent.close()


def raw_nixl_send(path: str, address: int, nbytes: int, count: int) -> None:
    import numpy as np

    from draftfeed.dataplane.nixl.memory import Region, host_memory
    from draftfeed.dataplane.nixl.transport import NixlAgent

    agent = NixlAgent("raw-nixl-send")
    with open(path, "rb") as source:
        remote_agent = agent.add_remote(source.read())
    # Bytes that are there: pages never written all map the kernel's one zero page, which a copy reads from cache.
    buffer = host_memory(nbytes)
    buffer[:] = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    local = Region(buffer.ctypes.data, nbytes)
    agent.register(local)
    remote = Region(address, nbytes)
    started = 0.0
    for index in range(count + 1):
        if index == 1:
            started = time.perf_counter()  # after one warm-up write
        transfer = agent.write([local], [remote], remote_agent, b"raw")
        while transfer.poll() == "PROC":
            pass
        transfer.release()
    elapsed = time.perf_counter() - started
    print(json.dumps({"bytes_per_s": nbytes * count / elapsed, "seconds": elapsed}), flush=True)
    agent.close()


_DISPATCH_REPLY_TO = re.compile(rb'"data_endpoint":"([^"]+)"')
_DISPATCH_TICKET = re.compile(rb'"ticket":(\d+)')
_SUBMIT_IDS = re.compile(rb'"request_id":(\d+),.*?"token":(\d+)')


def raw_worker(backend: str, count: int) -> None:
    """A minimal worker in raw pyzmq, so that the broker's own routing rate shows: it registers, then answers
    each dispatch with a one-frame result to the rank and a done to the broker, parsing only the ticket."""
    from draftfeed.schemas.frames import pack
    from draftfeed.schemas.messages import Eagle3TargetInfo, Register

    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTING_ID, b"raw-worker")
    sock.connect(backend)
    info = Eagle3TargetInfo(num_hidden_layers=32, hidden_size=4096, vocab_size=32000, aux_layer_ids=[1, 15, 28])
    sock.send_multipart(pack(Register(worker="raw-worker", service="raw", task="eagle3", engine="raw", info=info, capacity=64, host="h", pid=0)))
    ranks: dict[bytes, zmq.Socket] = {}
    served = 0
    more, last = int(zmq.SNDMORE), 0
    while served < count:
        frames = sock.recv_multipart()
        header = frames[1]
        if not header.startswith(b'{"type":"dispatch"'):
            if header.startswith(b'{"type":"heartbeat"'):
                sock.send_multipart([SIGNATURE, b'{"type":"heartbeat"}'])
            continue
        # Only what the answer needs, read straight from the header's bytes (pydantic writes them without spaces).
        endpoint = _DISPATCH_REPLY_TO.search(header).group(1)
        rank = ranks.get(endpoint)
        if rank is None:
            rank = ranks[endpoint] = context.socket(zmq.DEALER)
            rank.setsockopt(zmq.LINGER, 0)
            rank.connect(endpoint.decode())
        request_id, token = _SUBMIT_IDS.search(header).groups()
        rank.send(SIGNATURE, more)
        rank.send(b'{"type":"result","request_id":%s,"token":%s,"kind":"eagle3","worker":"raw-worker","tensors":[]}' % (request_id, token), last)
        sock.send(SIGNATURE, more)
        sock.send(b'{"type":"done","ticket":%s,"outcome":"served"}' % _DISPATCH_TICKET.search(header).group(1), last)
        served += 1
    for rank_sock in ranks.values():
        rank_sock.close(0)
    sock.close(0)
    context.term()


def raw_rank(frontend: str, count: int, window: int) -> None:
    """A minimal rank in raw pyzmq: hello, then ``count`` submits with ``window`` outstanding."""
    from draftfeed.schemas.frames import pack
    from draftfeed.schemas.messages import Hello

    context = zmq.Context()
    control, data = context.socket(zmq.DEALER), context.socket(zmq.ROUTER)
    for sock in (control, data):
        sock.setsockopt(zmq.LINGER, 0)
    control.setsockopt(zmq.ROUTING_ID, b"raw-rank")
    port = data.bind_to_random_port("tcp://127.0.0.1")
    control.connect(frontend)
    control.send_multipart(pack(Hello(rank="raw-rank", service="raw", data_endpoint=f"tcp://127.0.0.1:{port}", window=window, host="h", pid=0)))
    control.recv_multipart()  # welcome
    sent = received = 0
    more, last, nowait = int(zmq.SNDMORE), 0, int(zmq.NOBLOCK)
    started = time.perf_counter()
    while received < count:
        while sent < count and sent - received < window:
            control.send(SIGNATURE, more)
            control.send(b'{"type":"submit","request_id":%d,"kind":"eagle3","token":1}' % sent, last)
            sent += 1
        try:
            while True:  # every answer that is here, then back to sending
                data.recv_multipart(nowait)
                received += 1
        except zmq.Again:
            pass
        if sent - received >= window or sent == count:
            data.poll(100)
        if received % 256 == 0:
            while control.poll(0):
                control.recv_multipart()  # heartbeats
    elapsed = time.perf_counter() - started
    print(json.dumps({"requests_per_s": count / elapsed}), flush=True)
    control.close(0)
    data.close(0)
    context.term()


def timed_rank(frontend: str, service: str, rows: int, tokens: int, vocab: int, count: int) -> None:
    """One batch at a time (token_batch's), the mean seconds a call after one warm-up: a rank on another host."""
    from draftfeed import RemoteEagle3Target
    from draftfeed.bench.harness import seconds_per_call, token_batch

    batch = token_batch(rows, tokens, vocab)
    with RemoteEagle3Target(frontend, service, prefetch_depth=0, wait_for_workers=240) as target:
        target.model_info()
        print(json.dumps({"seconds": seconds_per_call(lambda: target.generate_batch(**batch), count)}), flush=True)


def raw_forwarder(count: int) -> None:
    """A policy-free broker between ``raw-rank`` and ``raw-worker``: the same messages as the real broker's (a
    welcome for the hello, a dispatch for each submit, a done read for each), no parsing beyond the message type, no
    records, no checks. The real broker's routing rate is measured against it."""
    context = zmq.Context()
    frontend, backend = context.socket(zmq.ROUTER), context.socket(zmq.ROUTER)
    for sock in (frontend, backend):
        sock.setsockopt(zmq.LINGER, 0)
    host = "tcp://127.0.0.1"
    endpoints = {"frontend": f"{host}:{frontend.bind_to_random_port(host)}", "backend": f"{host}:{backend.bind_to_random_port(host)}"}
    print(json.dumps(endpoints), flush=True)
    poller = zmq.Poller()
    poller.register(frontend, zmq.POLLIN)
    poller.register(backend, zmq.POLLIN)
    worker, rank_fields, ticket, done = b"", b"", 0, 0
    waiting: list[bytes] = []
    while done < count:
        events = dict(poller.poll(10_000))
        if not events:
            raise SystemExit("raw-forwarder: no message for 10 s")
        for peer, header in _waiting(backend) if backend in events else ():
            if header.startswith(b'{"type":"register"'):
                worker = peer
                for early in waiting:  # submits that came before the worker
                    ticket = _forward(backend, worker, ticket, rank_fields, early)
                waiting.clear()
            elif header.startswith(b'{"type":"done"'):
                done += 1
        for peer, header in _waiting(frontend) if frontend in events else ():
            if header.startswith(b'{"type":"hello"'):
                rank_fields = b'"data_endpoint":"%s"' % json.loads(header)["data_endpoint"].encode()
                frontend.send_multipart([peer, SIGNATURE, b'{"type":"welcome"}'])
            elif header.startswith(b'{"type":"submit"'):
                if worker:
                    ticket = _forward(backend, worker, ticket, rank_fields, header)
                else:
                    waiting.append(header)
    frontend.close(0)
    backend.close(0)
    context.term()


def _waiting(sock: zmq.Socket) -> Iterator[tuple[bytes, bytes]]:
    """The sender and header of each message waiting on a ROUTER, until none is left."""
    nowait = int(zmq.NOBLOCK)
    while True:
        try:
            peer, _signature, header, *_ = sock.recv_multipart(nowait)
        except zmq.Again:
            return
        yield peer, header


def _forward(backend: zmq.Socket, worker: bytes, ticket: int, rank_fields: bytes, submit: bytes) -> int:
    """One submit to the worker as a dispatch (the header the real broker writes); returns the next ticket."""
    more = int(zmq.SNDMORE)
    backend.send(worker, more)
    backend.send(SIGNATURE, more)
    backend.send(b'{"type":"dispatch","ticket":%d,%s,"request":%s}' % (ticket, rank_fields, submit))
    return ticket + 1


def main(argv: list[str]) -> None:
    command, *args = argv
    if command == "raw-send":
        raw_send(args[0], int(args[1]), int(args[2]))
    elif command == "raw-recv":
        raw_recv(int(args[0]), int(args[1]))
    elif command == "rank":
        rank(args[0], args[1], int(args[2]), int(args[3]), int(args[4]), *args[5:6])
    elif command == "raw-gloo-recv":
        raw_gloo_recv(int(args[0]), int(args[1]))
    elif command == "raw-gloo-send":
        raw_gloo_send(int(args[0]), int(args[1]), int(args[2]))
    elif command == "raw-nixl-recv":
        raw_nixl_recv(args[0], int(args[1]), int(args[2]))
    elif command == "raw-nixl-send":
        raw_nixl_send(args[0], int(args[1]), int(args[2]), int(args[3]))
    elif command == "raw-worker":
        raw_worker(args[0], int(args[1]))
    elif command == "raw-rank":
        raw_rank(args[0], int(args[1]), int(args[2]))
    elif command == "raw-forwarder":
        raw_forwarder(int(args[0]))
    elif command == "timed-rank":
        timed_rank(args[0], args[1], *(int(a) for a in args[2:6]))
    else:
        raise SystemExit(f"unknown probe {command!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
