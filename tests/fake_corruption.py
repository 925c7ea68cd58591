"""A worker whose answers are changed on their way to the rank on demand: ``python -m fake_corruption worker ...``
(tests/ on the path). ``FAKE_CORRUPT=N`` flips one byte of the first tensor of its N-th result sent as frames (one
message, or, for an answer in pieces, its first piece), after the answer's digests were made: bytes changed in
transit, as a bad NIC, a bad cable without link-level checks, or a bug in a transport would change them.

A fake because such a fault cannot be caused on demand from outside; everything else is the real worker.
"""

from __future__ import annotations

import json
import os
import sys

import draftfeed.consumers.answer_delivery as delivery
from draftfeed.launch.cli import launch_main


def install() -> None:
    nth = int(os.environ["FAKE_CORRUPT"])
    real_send = delivery.AnswerDelivery._send
    results = [0]

    def send(self, data_endpoint, frames, since=None):
        header = json.loads(bytes(memoryview(frames[1])))
        whole = header["type"] == "result" and header.get("chunk_bytes") is None and header.get("plane") == "frames"
        if (whole or header["type"] == "chunk" and header["index"] == 0) and len(frames) > 2:
            results[0] += 1
            if results[0] == nth:
                changed = bytearray(memoryview(frames[2]))  # a copy: the worker's own tensor stays as computed
                changed[len(changed) // 2] ^= 0x01
                frames = [*frames[:2], changed, *frames[3:]]
        return real_send(self, data_endpoint, frames, since)

    delivery.AnswerDelivery._send = send  # type: ignore[method-assign]


if __name__ == "__main__":
    install()
    sys.exit(launch_main())
