"""The loop of a peer of the broker: a rank's IO thread and a worker's broker link both run it; sessions decide.

A session (producers/rank_session.py, consumers/worker_session.py) holds a peer's protocol with the broker
and no socket: it reads messages, keeps time with the clock it was given, and puts what is to go to the
broker in its ``Outbox``. This loop moves frames between the sockets and the session. One turn: wait for
input up to the next heartbeat (or less, where the peer asks), settle the handshake watch until the broker
has answered once (a refused handshake is why no broker answers: the session is told and the loop ends),
hand what each socket holds to its reader, let the session do what each turn is for, send what its outbox
holds, and on each beat let the session say what is due (a heartbeat; an introduction again after a
silence). A reader that returns False ends the loop, after what the outbox holds has gone if it could.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import zmq

from draftfeed.broker_view import BrokerView
from draftfeed.security.handshake import HandshakeWatch


class Outbox:
    """What a session has for the broker, in order; sending it never blocks. A message that cannot go now waits
    behind what already waits, unless it is droppable (a heartbeat: the next one will do). Its length is bounded
    by what its session sends, which the credit window bounds."""

    def __init__(self) -> None:
        self._waiting: deque[tuple[list[Any], bool]] = deque()

    def put(self, frames: list[Any], *, droppable: bool = False) -> None:
        self._waiting.append((frames, droppable))

    def clear(self) -> None:
        """Drop what waits (a new introduction: the broker requeued or will be sent all of it again)."""
        self._waiting.clear()

    def pending(self) -> list[list[Any]]:
        """What waits to go, in order."""
        return [frames for frames, _droppable in self._waiting]

    def flush(self, sock: zmq.Socket) -> None:
        """Send what can go now; keep the rest, less what may be dropped, for the next flush."""
        while self._waiting:
            frames, _droppable = self._waiting[0]
            try:
                sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                self._waiting = deque(entry for entry in self._waiting if not entry[1])
                return
            self._waiting.popleft()


class BrokerPeer(Protocol):
    """What the loop needs of a session."""

    broker: BrokerView
    outbox: Outbox

    @property
    def answered(self) -> bool:
        """The broker has answered once (a welcome, a registration): its handshake need not be watched."""

    def handshake_refused(self, verdict: str) -> None:
        """The broker refused the handshake before it answered (the loop ends)."""

    def turn(self) -> None:
        """What each turn is for, after the sockets were read (a rank resends what its busy backoff held back)."""

    def beat(self) -> None:
        """A heartbeat is due: put it in the outbox, and an introduction again if the broker fell silent."""


Reader = Callable[[], bool]  # reads what its socket holds; False ends the loop


def run_peer_loop(
    peer: BrokerPeer,
    control: zmq.Socket,
    watch: HandshakeWatch | None,
    readers: Sequence[tuple[zmq.Socket, Reader]],
    wait_cap_s: Callable[[], float] | None = None,
    after_wait: Callable[[], None] | None = None,
) -> None:
    """Drive ``peer`` over ``control`` (its socket to the broker) and ``readers`` until a reader returns False or the
    handshake is refused. ``wait_cap_s``, called each turn, caps the wait, and ``after_wait`` runs after it (a rank
    awaiting a NIXL notification waits a millisecond, then asks NIXL). The loop closes ``watch``."""
    poller = zmq.Poller()
    for sock, _read in readers:
        poller.register(sock, zmq.POLLIN)
    if watch is not None:
        poller.register(watch.monitor, zmq.POLLIN)
    clock = peer.broker.clock
    next_beat = clock() + peer.broker.interval_s
    try:
        while True:
            wait_s = next_beat - clock()
            if wait_cap_s is not None:
                wait_s = min(wait_s, wait_cap_s())
            events = dict(poller.poll(max(0, int(wait_s * 1000))))
            if after_wait is not None:
                after_wait()
            if watch is not None:
                if watch.monitor in events:
                    watch.read()
                if watch.verdict is not None and not peer.answered:
                    peer.handshake_refused(watch.verdict)
                    return
                if peer.answered:
                    poller.unregister(watch.monitor)
                    watch.close()
                    watch = None
            for sock, read in readers:
                if sock in events and not read():
                    peer.outbox.flush(control)  # a last word (a worker's bye) goes if it can
                    return
            peer.turn()
            peer.outbox.flush(control)
            if clock() >= next_beat:
                peer.beat()
                peer.outbox.flush(control)
                next_beat = clock() + peer.broker.interval_s
    finally:
        if watch is not None:
            watch.close()
