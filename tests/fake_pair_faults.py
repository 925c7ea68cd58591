"""A worker whose pair-group sends fail on demand: ``python -m fake_pair_faults worker ...`` (tests/ on the path).

``FAKE_PAIR_FAULT=KIND:N`` makes the N-th send on a pair group send its first tensor and then
- ``exit``: the worker process dies at once (a worker killed in the middle of a send), or
- ``fail``: the send raises DataPlaneError, as a backend error or timeout would (a forced send failure).

A fake because neither fault can be caused on demand from outside at that exact point; everything else
is the real worker.
"""

from __future__ import annotations

import os
import sys

from draftfeed.dataplane.pair_group import DataPlaneError, PairGroup
from draftfeed.launch.cli import launch_main

EXIT_CODE = 17


def install() -> None:
    kind, _, nth = os.environ["FAKE_PAIR_FAULT"].partition(":")
    if kind not in ("exit", "fail"):
        raise SystemExit(f"FAKE_PAIR_FAULT={os.environ['FAKE_PAIR_FAULT']!r}: expected exit:N or fail:N")
    real_send = PairGroup.send
    sends = [0]

    def send(self: PairGroup, tensors):
        sends[0] += 1
        if sends[0] != int(nth):
            return real_send(self, tensors)
        first = next(iter(tensors))
        real_send(self, {first: tensors[first]})
        if kind == "exit":
            os._exit(EXIT_CODE)
        self.close()
        raise DataPlaneError(f"fake: send {sends[0]} failed after its first tensor")

    PairGroup.send = send  # type: ignore[method-assign]


if __name__ == "__main__":
    install()
    sys.exit(launch_main())
