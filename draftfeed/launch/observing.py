"""The /health and /metrics server a launch command starts on ``--http-port``."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from draftfeed.launch.options import Http
from draftfeed.schemas.errors import UsageError


def observe(http: Http, default_port: int, health: Callable[[], str | None], registry: Callable[[], Any], about: Callable[[], dict] = dict) -> Any:
    """The /health and /metrics server of --http-port, None when it is 0 (or the default port is taken)."""
    port = default_port if http.http_port is None else http.http_port
    if port == 0:
        return None
    if not 0 < port < 65536:
        raise UsageError(f"--http-port {port}: give a port from 1 to 65535, or 0 to turn health and metrics off")
    from draftfeed.observe.http import ObserveServer

    try:
        return ObserveServer(http.http_host, port, health, registry, about=about)
    except UsageError as exc:
        if http.http_port is not None:
            raise
        logging.getLogger("draftfeed.observe").warning("health and metrics are off: %s (several on one machine need --http-port each)", exc)
        return None
