"""What the commands do on a signal: the broker and a worker stop cleanly on the first SIGTERM or SIGINT and exit
at once on a second; the demo and the bench stop the processes they started, whenever the signal comes."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable


def stop_on_signals(stop: Callable[[], None], what: str) -> None:
    """SIGTERM or SIGINT: stop cleanly; a second one: exit at once (a scheduler's grace period is running out)."""
    received: list[int] = []

    def handle(sig: int, _frame: object) -> None:
        if received:
            print(f"draftfeed {what}: {signal.Signals(sig).name} again: exiting now", file=sys.stderr, flush=True)
            os._exit(128 + sig)
        received.append(sig)
        print(f"draftfeed {what}: {signal.Signals(sig).name}: stopping (another one exits at once)", file=sys.stderr, flush=True)
        stop()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, handle)


def stopping_children(what: str, run: Callable[[], int]) -> int:
    """Run ``run`` (the demo, the bench) so that SIGTERM, SIGINT or SIGHUP at any moment, from before its first child
    starts, stops the processes it started: the first one ends it (the ``finally`` blocks on the way out stop them and
    remove its folder) with exit status 128 + the signal; one that comes while they are being stopped kills them at
    once. Should it be SIGKILLed instead, they die with it all the same (``children.spawn``)."""
    from draftfeed.processes import children

    received: list[int] = []

    def handle(sig: int, _frame: object) -> None:
        first = not received and not children.stopping()
        received.append(sig)
        name = signal.Signals(sig).name
        if first:
            print(f"draftfeed {what}: {name}: stopping the processes it started (another one kills them)", file=sys.stderr, flush=True)
            raise SystemExit(128 + sig)
        print(f"draftfeed {what}: {name} again: killing the processes it started", file=sys.stderr, flush=True)
        children.kill_all()

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, handle)
    try:
        code = run()
    finally:
        children.stop_all()
    return 128 + received[0] if received else code
