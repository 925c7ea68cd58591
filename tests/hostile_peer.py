"""A hostile peer, run as its own process: floods the broker and a rank's data socket with bad messages.

Usage: python hostile_peer.py FRONTEND BACKEND RANK_DATA_ENDPOINT VICTIM_RANK_ID COUNT SEED
Prints one JSON line: how many messages went where and how many replies came back.
"""

from __future__ import annotations

import json
import random
import sys

import zmq

from draftfeed.schemas.protocol import SIGNATURE as SIG


def spec(name, dtype, shape):
    return {"name": name, "dtype": dtype, "shape": shape}


def broker_junk(rng: random.Random, victim: str, my_id: str) -> list[bytes]:
    """One malformed (or hostile) message for the broker's ports."""
    kind = rng.randrange(14)
    if kind == 0:
        return [rng.randbytes(rng.randrange(0, 64)) for _ in range(rng.randrange(1, 8))]
    if kind == 1:
        header = json.dumps({"type": "submit", "request_id": 1, "kind": "eagle3", "tensors": [spec("input_ids", "int64", [1, 4])]}).encode()
        return [SIG, header[: rng.randrange(1, len(header))]]
    if kind == 2:
        return [SIG, b"{" + b" " * (1 << 20) + b"}"]
    if kind == 3:
        return [SIG, rng.randbytes(rng.randrange(1, 200))]
    if kind == 4:
        return [b"draftfeed/" + str(rng.randrange(2, 99)).encode(), b"{}"]
    if kind == 5:
        return [SIG, json.dumps({"type": rng.choice(["launch", "admin", "eval", "__class__"])}).encode()]
    if kind == 6:  # hello for a service nobody serves, under its own name: accepted, then its submits
        return [
            SIG,
            json.dumps(
                {
                    "type": "hello",
                    "rank": my_id,
                    "service": f"nope-{rng.randrange(5)}",
                    "data_endpoint": "tcp://127.0.0.1:9",
                    "window": 2,
                    "host": "x",
                    "pid": 1,
                }
            ).encode(),
        ]
    if kind == 7:  # shapes that do not match the buffers
        header = {"type": "submit", "request_id": rng.randrange(1 << 30), "kind": "eagle3", "tensors": [spec("input_ids", "int64", [2, 3])]}
        return [SIG, json.dumps(header).encode(), b"\0" * rng.randrange(0, 40)]
    if kind == 8:  # declared sizes far beyond the limit
        header = {"type": "submit", "request_id": 3, "kind": "eagle3", "tensors": [spec("input_ids", "int64", [1 << 30, 1 << 30])]}
        return [SIG, json.dumps(header).encode(), b""]
    if kind == 9:  # unknown dtype
        header = {"type": "submit", "request_id": 4, "kind": "eagle3", "tensors": [spec("input_ids", "complex256", [1, 1])]}
        return [SIG, json.dumps(header).encode(), b"\0" * 32]
    if kind == 10:  # a hello that claims to be the victim rank
        return [
            SIG,
            json.dumps(
                {"type": "hello", "rank": victim, "service": "svc", "data_endpoint": "tcp://127.0.0.1:9", "window": 64, "host": "x", "pid": 1}
            ).encode(),
        ]
    if kind == 11:  # a worker message on the rank port, or a done for a ticket it never had
        return [SIG, json.dumps({"type": "done", "ticket": rng.randrange(1000), "outcome": "served"}).encode()]
    if kind == 12:  # negative and huge numbers, wrong types
        return [SIG, json.dumps({"type": "submit", "request_id": rng.choice([-1, 2**70, "x", None]), "kind": "eagle3"}).encode()]
    return [SIG, json.dumps({"type": "model_info", "request_id": rng.randrange(100)}).encode(), b"extra frame"]


def data_junk(rng: random.Random) -> list[bytes]:
    """A forged or broken answer for the rank's data socket."""
    kind = rng.randrange(4)
    if kind == 0:  # a result for a plausible request id with a guessed token
        header = {
            "type": "result",
            "request_id": rng.randrange(64),
            "token": rng.randrange(1 << 63),
            "kind": "eagle3",
            "worker": "evil",
            "tensors": [],
        }
        return [SIG, json.dumps(header).encode()]
    if kind == 1:
        header = {"type": "failure", "request_id": rng.randrange(64), "token": rng.randrange(1 << 63), "worker": "evil", "message": "fake"}
        return [SIG, json.dumps(header).encode()]
    if kind == 2:
        return [SIG, b"[1,2,3]"]
    return [rng.randbytes(rng.randrange(1, 100))]


def main() -> None:
    frontend, backend, data, victim, count, seed = sys.argv[1:7]
    rng = random.Random(int(seed))
    context = zmq.Context()
    peers = []
    for index in range(8):
        sock = context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTING_ID, f"hostile-{index}".encode())
        sock.connect(frontend if index < 6 else backend)
        peers.append(sock)
    forger = context.socket(zmq.DEALER)
    forger.setsockopt(zmq.LINGER, 0)
    forger.setsockopt(zmq.SNDTIMEO, 2000)
    forger.connect(data)
    sent = {"broker": 0, "data": 0}
    replies = 0
    poller = zmq.Poller()
    for sock in peers:
        poller.register(sock, zmq.POLLIN)
    for index in range(int(count)):
        if index % 10 == 9:
            try:
                forger.send_multipart(data_junk(rng))
                sent["data"] += 1
            except zmq.Again:
                pass
            continue
        which = rng.randrange(len(peers))
        peers[which].send_multipart(broker_junk(rng, victim, f"hostile-{which}"))
        sent["broker"] += 1
        for sock, _ in poller.poll(0):
            while sock.poll(0):
                sock.recv_multipart()
                replies += 1
    while True:  # collect the last replies: the broker may still be working through the flood
        events = poller.poll(3000)
        if not events:
            break
        for sock, _ in events:
            while sock.poll(0):
                sock.recv_multipart()
                replies += 1
    print(json.dumps({"sent": sent, "replies": replies}), flush=True)
    for sock in [*peers, forger]:
        sock.close(0)
    context.term()


if __name__ == "__main__":
    main()
