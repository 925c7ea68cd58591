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

import logging
import os
import threading
from collections.abc import Callable
from typing import Any

from draftfeed.consumers.engines.parallel.followers import FollowerProcesses
from draftfeed.consumers.engines.parallel.group import interface_towards
from draftfeed.consumers.engines.parallel.rendezvous import MEETING_KEY, join_node_zero
from draftfeed.consumers.engines.parallel.spec import FollowerSpec, Meeting, TargetSpec
from draftfeed.consumers.engines.parallel.watch import stop_on_signals
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
    store = join_node_zero(nodes, plan, join_timeout_s)
    if settings.engine == "vllm":  # vLLM starts its own processes here (vllm_nodes.py)
        from draftfeed.consumers.engines.vllm_nodes import serve_vllm_node

        return serve_vllm_node(settings, store, nodes, on_ready)
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
    stop = stop_on_signals(ended)
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
