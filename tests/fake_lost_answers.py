"""A worker whose N-th answer never reaches its rank although the worker takes it for sent: ``python -m
fake_lost_answers worker ...`` (tests/ on the path), ``FAKE_LOSE=N``. Its done says ``served``, so the broker lets the
request go while the rank still waits for it: what a worker SIGKILLed between its done and its answer's last bytes
leaves behind (libzmq sends both from its own threads; the done to the broker can leave the process first, and the
answer's bytes die with it), or a message dropped on its way.

A fake because that moment cannot be hit on demand from outside; everything else is the real worker.
"""

from __future__ import annotations

import json
import os
import sys

import draftfeed.consumers.answer_delivery as delivery
from draftfeed.dataplane.frames.worker import SendResult
from draftfeed.launch.cli import launch_main


def install() -> None:
    nth = int(os.environ["FAKE_LOSE"])
    real_send = delivery.AnswerDelivery._send
    results = [0]

    def send(self, data_endpoint, frames, since=None):
        header = json.loads(bytes(memoryview(frames[1])))
        if header["type"] == "result":
            results[0] += 1
            if results[0] == nth:
                return SendResult.SENT  # as if libzmq had taken it, and it died with the process
        return real_send(self, data_endpoint, frames, since)

    delivery.AnswerDelivery._send = send  # type: ignore[method-assign]


if __name__ == "__main__":
    install()
    sys.exit(launch_main())
