"""``draftfeed launch broker``: bind, serve /health and /metrics, run until a signal."""

from __future__ import annotations

import argparse

from draftfeed.launch import flags
from draftfeed.launch.observing import observe
from draftfeed.launch.options import BrokerCommand
from draftfeed.launch.signals import stop_on_signals
from draftfeed.processes.ready import announce_ready
from draftfeed.schemas.protocol import DEFAULT_BROKER_HTTP_PORT


def run_broker(args: argparse.Namespace) -> int:
    from prometheus_client import CollectorRegistry

    from draftfeed.broker.broker import Broker
    from draftfeed.observe.broker_metrics import BrokerCollector

    command = flags.from_args(BrokerCommand, args)
    listen = command.listen
    broker = Broker(listen.frontend, listen.backend, name=listen.name, settings=command.broker, keys=command.security.broker_keys())
    frontend, backend = broker.bind()
    registry = CollectorRegistry()
    registry.register(BrokerCollector(broker.fresh_status))
    observer = observe(command.http, DEFAULT_BROKER_HTTP_PORT, broker.health, lambda: registry)
    stop_on_signals(broker.stop, "broker")
    announce_ready(role="broker", frontend=frontend, backend=backend, http_port=observer.port if observer else None)
    _tune_garbage_collection()
    try:
        broker.run()
    finally:
        if observer is not None:
            observer.close()
    return 0


def _tune_garbage_collection() -> None:
    """The broker process holds a record for every peer, request and pair, and allocates a few objects per message:
    with Python's default thresholds its collector ran every 700 allocations, so often that it cost a fifth of the
    broker's CPU at a thousand ranks (docs/performance.md, "One broker for a cluster"). What is loaded at start is
    frozen out of collection, and the youngest generation is collected every 100,000 allocations instead."""
    import gc

    gc.collect()
    gc.freeze()
    gc.set_threshold(100_000, 50, 1000)
