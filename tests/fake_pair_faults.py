"""A worker whose pair-group sends or NIXL writes fail on demand: ``python -m fake_pair_faults worker ...`` (tests/ on
the path).

``FAKE_PAIR_FAULT=KIND:N`` makes the N-th send on a pair group send its first tensor and then
- ``exit``: the worker process dies at once (a worker killed in the middle of a send), or
- ``fail``: the send raises DataPlaneError, as a backend error or timeout would (a forced send failure).

``FAKE_NIXL_FAULT=KIND:N`` makes the N-th NIXL write of the worker
- ``exit``: land in the rank's slot, and then the worker dies before it sends the header (killed mid-answer), or
- ``fail``: raise NixlError without writing, as a write that cannot start does, or
- ``late``: count as posted (its header goes out) but move nothing and report an error when checked, as a write
  that fails in flight does: no bytes land and no notification comes.

A fake because neither fault can be caused on demand from outside at that exact point; everything else
is the real worker, with the real NIXL.
"""

from __future__ import annotations

import os
import sys

from draftfeed.dataplane.pair_group import DataPlaneError, PairGroup
from draftfeed.launch.cli import launch_main

EXIT_CODE = 17


class FakeFailedWrite:
    """A posted write that failed in flight: nothing landed, no notification; checking it raises."""

    def __init__(self, message: str) -> None:
        self.message = message

    def done(self) -> bool:
        from draftfeed.dataplane.nixl_transport import NixlError

        raise NixlError(self.message)

    wait = done


def install_nixl() -> None:
    from draftfeed.consumers.nixl_senders import NixlSender
    from draftfeed.dataplane.nixl_transport import NixlError

    kind, _, nth = os.environ["FAKE_NIXL_FAULT"].partition(":")
    if kind not in ("exit", "fail", "late"):
        raise SystemExit(f"FAKE_NIXL_FAULT={os.environ['FAKE_NIXL_FAULT']!r}: expected exit:N, fail:N or late:N")
    real_post = NixlSender.post
    writes = [0]

    def post(self: NixlSender, *args, **kwargs):
        writes[0] += 1
        if writes[0] != int(nth):
            return real_post(self, *args, **kwargs)
        if kind == "exit":
            real_post(self, *args, **kwargs).wait()
            os._exit(EXIT_CODE)
        if kind == "late":
            return FakeFailedWrite(f"fake: NIXL write {writes[0]} failed in flight")
        raise NixlError(f"fake: NIXL write {writes[0]} failed")

    NixlSender.post = post  # type: ignore[method-assign]


def install() -> None:
    if "FAKE_NIXL_FAULT" in os.environ:
        install_nixl()
    if "FAKE_PAIR_FAULT" not in os.environ:
        return
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
