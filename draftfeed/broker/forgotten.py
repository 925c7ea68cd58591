"""Peers the broker dropped, remembered by name with why, so that the next message of one is answered with the
reason (``forgotten``) instead of a bare "unknown". Bounded: the oldest are forgotten for good."""

from __future__ import annotations

from collections import OrderedDict

KEPT = 4096


class ForgottenPeers:
    def __init__(self, kept: int = KEPT) -> None:
        self._why: OrderedDict[bytes, str] = OrderedDict()
        self._kept = kept

    def remember(self, peer: bytes, why: str) -> None:
        self._why[peer] = why
        self._why.move_to_end(peer)
        while len(self._why) > self._kept:
            self._why.popitem(last=False)

    def why(self, peer: bytes) -> str | None:
        return self._why.get(peer)

    def take(self, peer: bytes) -> str | None:
        """The peer is back: forget that it was forgotten; returns why it had been."""
        return self._why.pop(peer, None)
