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
import time

from draftfeed.dataplane.pair_group.transport import DataPlaneError, PairGroup
from draftfeed.launch.cli import launch_main
from draftfeed.schemas.protocol import DEFAULT_TRANSFER_CHUNK_BYTES

EXIT_CODE = 17


class FakeFailedTransfer:
    """A posted write that failed in flight: nothing landed, no notification; NIXL reports it in error."""

    state = "ERR"

    def poll(self) -> str:
        return "ERR"

    def release(self) -> None:
        pass


def install_nixl() -> None:
    """The fault goes in at the NIXL agent's write, so that the worker's own handling of a write that cannot start
    or fails in flight (its memory let go, or kept while the transfer may read it) runs as with a real fault."""
    from draftfeed.dataplane.nixl.transport import NixlAgent, NixlError

    kind, _, nth = os.environ["FAKE_NIXL_FAULT"].partition(":")
    if kind not in ("exit", "fail", "late"):
        raise SystemExit(f"FAKE_NIXL_FAULT={os.environ['FAKE_NIXL_FAULT']!r}: expected exit:N, fail:N or late:N")
    real_write = NixlAgent.write
    writes = [0]

    def write(self: NixlAgent, *args, **kwargs):
        writes[0] += 1
        if writes[0] != int(nth):
            return real_write(self, *args, **kwargs)
        if kind == "exit":
            transfer, deadline = real_write(self, *args, **kwargs), time.monotonic() + 30
            while transfer.poll() == "PROC" and time.monotonic() < deadline:
                pass  # until the bytes have landed in the rank's slot
            os._exit(EXIT_CODE)
        if kind == "late":
            return FakeFailedTransfer()
        raise NixlError(f"fake: NIXL write {writes[0]} failed")

    NixlAgent.write = write  # type: ignore[method-assign]


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

    def send(self: PairGroup, tensors, chunk_bytes=DEFAULT_TRANSFER_CHUNK_BYTES):
        sends[0] += 1
        if sends[0] != int(nth):
            return real_send(self, tensors, chunk_bytes)
        first = next(iter(tensors))
        real_send(self, {first: tensors[first]}, chunk_bytes)
        if kind == "exit":
            os._exit(EXIT_CODE)
        self.close()
        raise DataPlaneError(f"fake: send {sends[0]} failed after its first tensor")

    PairGroup.send = send  # type: ignore[method-assign]


if __name__ == "__main__":
    install()
    sys.exit(launch_main())
