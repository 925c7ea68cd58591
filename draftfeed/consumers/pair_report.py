"""Which pairs a worker's heartbeat reports: what changed, not everything.

A worker with a thousand ranks has a thousand pairs; listing them all in every heartbeat made each one hundreds of
kilobytes for the broker to read. Each heartbeat instead carries the pairs whose status changed since the last one
(at most ``PAIRS_PER_BEAT``; the rest wait for the next heartbeats) and, with what room is left, up to
``REFRESH_PER_BEAT`` unchanged ones in turn, so that what a lost heartbeat carried reaches the broker a little
later anyway. After a registration the broker holds none of them: ``reset`` reports all again, in as many
heartbeats as that takes. A pair that goes away (its rank forgotten, the worker registered afresh) needs no report:
the broker drops it itself.
"""

from __future__ import annotations

import threading

from draftfeed.schemas.messages import PairStatus
from draftfeed.schemas.protocol import PAIRS_PER_BEAT

REFRESH_PER_BEAT = 4


class PairReport:
    def __init__(self) -> None:
        self._reported: dict[str, PairStatus] = {}  # by rank: what the broker was last told
        self._turn = 0  # where the refresh of unchanged pairs goes on
        self._lock = threading.Lock()  # the link thread reports; a registration resets from the same thread, or another

    def reset(self) -> None:
        with self._lock:
            self._reported.clear()

    def changes(self, statuses: list[PairStatus]) -> list[PairStatus]:
        """What one heartbeat reports of ``statuses`` (every pair the worker has now)."""
        with self._lock:
            changed = [status for status in statuses if self._reported.get(status.rank) != status][:PAIRS_PER_BEAT]
            room = min(REFRESH_PER_BEAT, PAIRS_PER_BEAT - len(changed))
            refresh: list[PairStatus] = []
            if room > 0 and len(statuses) > len(changed):
                taken = {status.rank for status in changed}
                for offset in range(len(statuses)):
                    status = statuses[(self._turn + offset) % len(statuses)]
                    if status.rank not in taken:
                        refresh.append(status)
                        if len(refresh) == room:
                            break
                self._turn = (self._turn + room) % len(statuses)
            current = {status.rank for status in statuses}
            self._reported = {rank: status for rank, status in self._reported.items() if rank in current}
            for status in changed:
                self._reported[status.rank] = status
            return changed + refresh
