"""Waiting for an answer the way a training loop needs to: bounded, and saying what it waits for and why."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from draftfeed.schemas.errors import RemoteTargetTimeout

log = logging.getLogger("draftfeed.producer")


def wait_for(
    future: Future,
    what: str,
    service: str,
    timeout_s: float,
    log_interval_s: float,
    why_no_answer: Callable[[Future], str],
    in_flight: Callable[[], int],
) -> Any:
    """``future``'s result; every ``log_interval_s`` a warning says what it waits for and why no answer came yet
    (``why_no_answer``: also where the broker last said this future's request was); after ``timeout_s``
    (request_timeout) a RemoteTargetTimeout says the same. An answer that arrives in pieces (the future's
    ``progressed_at``) keeps the wait going: the timeout runs from its last piece."""
    started = time.monotonic()
    while True:
        deadline = max(started, getattr(future, "progressed_at", None) or started) + timeout_s
        remaining = deadline - time.monotonic()
        try:
            return future.result(timeout=max(0.0, min(remaining, log_interval_s)))
        except FutureTimeout:
            if time.monotonic() >= deadline:
                raise RemoteTargetTimeout(
                    f"no answer with {what} from service {service!r} within {timeout_s:.0f} s (request_timeout): "
                    f"{why_no_answer(future)}; check `draftfeed status`"
                ) from None
            log.warning(
                "draftfeed: waiting %.0f s for %s from service %r (%d batches in flight): %s",
                time.monotonic() - started,
                what,
                service,
                in_flight(),
                why_no_answer(future),
            )
