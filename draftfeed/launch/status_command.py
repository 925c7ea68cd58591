"""``draftfeed status``: the broker's services, workers, ranks and queues, once, until a service is ready, or again
and again."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from draftfeed.launch import flags
from draftfeed.launch.options import PeerKeyFiles
from draftfeed.schemas.errors import DraftfeedError, UsageError


def run_status(args: argparse.Namespace) -> int:
    """Print the status; with --service, exit 1 unless the service has a ready worker (within --wait seconds)."""
    import time

    from draftfeed.observe.status_client import fetch_for_people, format_status, ready_workers

    if args.wait and args.service is None:
        raise UsageError("--wait goes with --service NAME: the service to wait for")
    keys = flags.from_args(PeerKeyFiles, args).peer_keys("rank", required=False)
    if args.watch is not None:
        return _watch_status(args, keys)
    deadline = time.monotonic() + args.wait
    while True:
        status = fetch_for_people(args.broker, args.timeout, keys, everything=args.list or args.json, pairs=args.pairs)
        ready = ready_workers(status, args.service) if args.service is not None else None
        if ready is None or ready > 0 or time.monotonic() >= deadline:
            break
        time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
    print(json.dumps(status, indent=2) if args.json else format_status(status))
    if ready == 0:
        print(
            f"draftfeed status: service {args.service!r} has no ready worker at {args.broker}" + (f" after {args.wait:g} s" if args.wait else ""),
            file=sys.stderr,
        )
        return 1
    return 0


def _watch_status(args: argparse.Namespace, keys: Any) -> int:
    """``status --watch``: the status again every interval; on a terminal the screen is redrawn in place, elsewhere
    each one follows the last after a separator line. A broker that stops answering is said, and watched for.

    Ctrl-C (SIGINT) ends it after the refresh under way, never inside one: a socket left half closed would keep the
    process from exiting. A second Ctrl-C interrupts whatever it is doing."""
    import signal
    import threading
    import time

    from draftfeed.observe.status_client import fetch_for_people, format_status

    if args.watch <= 0:
        raise UsageError(f"--watch {args.watch:g}: give the seconds between refreshes, more than 0")
    terminal = sys.stdout.isatty()
    stop = threading.Event()

    def interrupted(_signum: int, _frame: object) -> None:
        stop.set()
        signal.signal(signal.SIGINT, signal.default_int_handler)

    previous = signal.signal(signal.SIGINT, interrupted)
    try:
        while not stop.is_set():
            try:
                status = fetch_for_people(args.broker, args.timeout, keys, everything=args.list or args.json, pairs=args.pairs)
                text = json.dumps(status, indent=2) if args.json else format_status(status)
            except DraftfeedError as exc:
                text = f"draftfeed status: {exc}"
            stamp = time.strftime("%H:%M:%S")
            if terminal:
                print(f"\x1b[H\x1b[2J{stamp}  every {args.watch:g} s, Ctrl-C to stop\n{text}", flush=True)
            else:
                print(f"---- {stamp}\n{text}", flush=True)
            stop.wait(args.watch)
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGINT, previous)
    return 0
