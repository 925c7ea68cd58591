"""The liveness of a tensor-parallel worker's processes, apart from their collectives.

A collective waits for every rank, and a rank on a machine that is gone never comes: without a watch of its own,
each side would wait for the collective's timeout (minutes). So every follower says it is alive to rank 0 once a
``WATCH_INTERVAL_S`` on a socket of their own, and rank 0 answers each time, on a thread of each side that no
collective blocks:

- rank 0 (``LeaderWatch``) calls ``on_silent`` once, naming the process, its node and how long it was silent, when a
  follower it heard from is silent for ``WATCH_SILENCE_S``: the worker stops (engine.py, loss.py);
- a follower (``FollowerWatch``) that does not hear rank 0 for ``WATCH_SILENCE_S`` logs one line and ends its
  process at once, whatever it is blocked in: rank 0's machine is gone, its link cut, or its process killed. A
  follower that has processes of its own to stop first (a vLLM node: vllm_nodes.py) is told instead (``on_silent``).

A node other than node 0 also ends on SIGTERM or SIGINT (``stop_on_signals``: node.py, vllm_nodes.py).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from collections.abc import Callable

import zmq

log = logging.getLogger("draftfeed.worker")

WATCH_INTERVAL_S = 1.0
WATCH_SILENCE_S = 15.0  # long enough for a starved thread on a loaded host (a 2-core machine running many processes)
SILENT_LEADER_EXIT_CODE = 75


class LeaderWatch:
    """Rank 0's end: a ROUTER on ``bind`` (tcp://HOST:* across machines, ipc:// on one) answering each beat."""

    def __init__(self, bind: str, on_silent: Callable[[str], None]) -> None:
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(bind)
        self.endpoint = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._on_silent = on_silent
        self._heard: dict[bytes, tuple[float, dict]] = {}  # identity -> (when heard last, what it said it is)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="draftfeed-tp-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        fired = False
        while not self._stop.is_set():
            if self._socket.poll(int(WATCH_INTERVAL_S * 500)):
                identity, body = self._socket.recv_multipart()
                self._heard[identity] = (time.monotonic(), json.loads(body))
                self._socket.send_multipart([identity, b"alive"])
                continue
            now = time.monotonic()
            for when, who in list(self._heard.values()):
                if not fired and now - when > WATCH_SILENCE_S:
                    fired = True
                    self._on_silent(
                        f"its {who['what']} (pid {who['pid']} on node {who['node']}, host {who['host']}) has been silent for "
                        f"{now - when:.1f} s (its machine or the link to it is down, or the process hangs)"
                    )
        self._socket.close(0)
        self._context.term()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


class FollowerWatch:
    """A follower's end: beats to rank 0's watch at ``endpoint``; ends this process when rank 0 is silent."""

    def __init__(
        self, endpoint: str, rank: int, node: int, host: str, what: str | None = None, on_silent: Callable[[str], None] | None = None
    ) -> None:
        self._endpoint = endpoint
        what = what or f"tensor-parallel process rank {rank}"
        self._about = json.dumps({"what": what, "node": node, "host": host, "pid": os.getpid()}).encode()
        self._what = what
        self._on_silent = on_silent
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="draftfeed-tp-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        context = zmq.Context()
        sock = context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self._endpoint)
        heard = time.monotonic()
        try:
            while not self._stop.is_set():
                try:
                    sock.send(self._about, zmq.NOBLOCK)
                except zmq.Again:  # not connected (yet, or any more): the silence below counts
                    pass
                deadline = time.monotonic() + WATCH_INTERVAL_S
                while (left := deadline - time.monotonic()) > 0 and not self._stop.is_set():
                    if sock.poll(int(left * 1000) + 1):
                        sock.recv()
                        heard = time.monotonic()
                if time.monotonic() - heard > WATCH_SILENCE_S and not self._stop.is_set():
                    why = (
                        f"rank 0 of this worker at {self._endpoint} has been silent for {time.monotonic() - heard:.1f} s "
                        "(its machine or the link to it is down, or it was killed)"
                    )
                    if self._on_silent is not None:
                        self._on_silent(why)
                        return
                    log.error("%s: %s: this process exits", self._what, why)
                    logging.shutdown()
                    os._exit(SILENT_LEADER_EXIT_CODE)
        finally:
            sock.close(0)
            context.term()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def stop_on_signals(ended: threading.Event) -> list[str]:
    """SIGTERM and SIGINT end the node's processes; the list says which came."""
    came: list[str] = []

    def handler(signum: int, _frame: object) -> None:
        came.append(signal.Signals(signum).name)
        ended.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    return came
