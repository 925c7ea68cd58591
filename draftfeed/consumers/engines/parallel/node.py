"""A node other than node 0 of a worker that spans machines: ``draftfeed launch worker ... --node-rank R`` there.

It talks to no broker and to no rank. It joins node 0's store at --master-addr, says it has joined (node 0 waits for
every node), checks its plan against node 0's (the target's config, engine, dtype, degree, node count and task
flags) and that no other machine took its rank, then starts its share of the worker's processes (global ranks
R x per node onwards, one on each of its --devices) and watches them. A node that differs, or comes twice, is one
line here and, through the store, on node 0, which stops. A node 0 that never comes is one line after
--join-timeout.

It ends when its processes end: all of them when the worker on node 0 stops (exit 0), or the first that ends
otherwise, the others then killed (exit 1), among them when node 0 falls silent (each process's watch). SIGTERM or
SIGINT here ends its processes too. They die with it however it ends (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from draftfeed.consumers.engines.parallel.engine import MEETING_KEY, NODE_KEY, PLAN_KEY, REFUSED_KEY
from draftfeed.consumers.engines.parallel.followers import FollowerProcesses
from draftfeed.consumers.engines.parallel.group import interface_towards
from draftfeed.consumers.engines.parallel.spec import FollowerSpec, Meeting, TargetSpec
from draftfeed.consumers.nodes import NodePlan, describe_difference
from draftfeed.consumers.settings import TargetSettings
from draftfeed.schemas.errors import CannotServe

log = logging.getLogger("draftfeed.worker")


def serve_node(settings: TargetSettings, plan: dict[str, Any], on_ready: Callable[[], None] | None = None) -> int:
    """Join node 0 as the node ``settings`` place this machine at (its ``devices`` resolved), start this node's
    processes (then ``on_ready``), and serve until they end; CannotServe says why it could not join, or how its
    processes ended. ``plan``: what node 0 checks against its own."""
    nodes, devices, join_timeout_s = settings.node_plan(), list(settings.devices), settings.join_timeout_s
    assert nodes is not None and nodes.node_rank > 0, "node 0 is the worker: load_engine serves it"
    where = f"node {nodes.node_rank} of --nnodes {nodes.nnodes}"
    try:
        store = dist.TCPStore(nodes.master_host, nodes.master_port, is_master=False, timeout=timedelta(seconds=join_timeout_s))
    except (RuntimeError, TimeoutError) as exc:
        raise CannotServe(
            f"{where}: no node 0 answered at --master-addr {nodes.master} within {join_timeout_s:.0f} s ({type(exc).__name__}); start "
            "the worker's node 0 (--node-rank 0) there first, and check that this machine reaches that address"
        ) from None
    if store.add(NODE_KEY.format(nodes.node_rank), 1) > 1:
        _refuse(store, nodes, f"two machines started as --node-rank {nodes.node_rank} of the worker at {nodes.master}: give each its own rank")
    theirs = json.loads(store.get(PLAN_KEY))
    if (difference := describe_difference(plan, theirs, f"node {nodes.node_rank}", "node 0")) is not None:
        _refuse(store, nodes, f"{where} runs another plan than node 0: {difference}; start every node with the same line but --node-rank")
    meeting = Meeting.model_validate_json(store.get(MEETING_KEY))
    interface = interface_towards(nodes.master_host)
    built = TargetSpec(
        engine=settings.engine,
        target=settings.path,
        dtype=settings.dtype,
        options=dict(settings.engine_options),
        expert_parallel=settings.expert_parallel,
    )
    specs = [
        FollowerSpec(
            target=built,
            meeting=meeting,
            rank=rank,
            local_rank=local,
            node_rank=nodes.node_rank,
            device=devices[local],
            interface=interface,
            parent_pid=os.getpid(),
        )
        for local, rank in enumerate(nodes.ranks())
    ]
    ended = threading.Event()
    first_failure: list[str] = []

    def on_exit(how: str) -> None:
        first_failure.append(how)
        ended.set()

    processes = FollowerProcesses(specs, on_exit, expected_exit=True)
    log.info("%s: joined the worker at %s (interface %s); its ranks %s run here", where, nodes.master, interface, list(nodes.ranks()))
    if on_ready is not None:
        on_ready()
    stop = _stop_on_signals(ended)
    try:
        while not ended.wait(0.5) and not processes.all_ended():
            pass
    finally:
        if first_failure or stop:
            processes.kill()
        else:
            processes.stop()
    if stop:
        log.info("%s: %s: its processes stopped", where, stop[0])
        return 0
    if first_failure:
        raise CannotServe(f"{where}: {first_failure[0]}; this node's other processes were stopped")
    log.info("%s: the worker on node 0 stopped; this node's processes exited", where)
    return 0


def _refuse(store: dist.TCPStore, nodes: NodePlan, why: str) -> None:
    """Tell node 0 why this node does not join (it stops with the same line), and stop here."""
    store.set(REFUSED_KEY.format(nodes.node_rank), why)
    raise CannotServe(why)


def _stop_on_signals(ended: threading.Event) -> list[str]:
    """SIGTERM and SIGINT end the node's processes; the list says which came."""
    came: list[str] = []

    def handler(signum: int, _frame: object) -> None:
        came.append(signal.Signals(signum).name)
        ended.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    return came
