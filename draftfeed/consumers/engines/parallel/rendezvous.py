"""How the nodes of a worker over machines meet before anything loads: node 0 hosts a store at --master-addr and
publishes its plan; every other node joins, says so, and checks its plan against node 0's. Node 0 waits for every
node; a node that refuses (another plan, a rank taken twice) says why in the store, and node 0 stops with that line.
Used by every engine that spans machines (parallel/engine.py for hf, sglang and automodel; vllm_nodes.py for vllm)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from draftfeed.consumers.nodes import NodePlan, describe_difference
from draftfeed.schemas.errors import CannotServe

# Keys of node 0's store that the other nodes read (PLAN, MEETING) and write (NODE, REFUSED).
PLAN_KEY, MEETING_KEY = "draftfeed/plan", "draftfeed/meeting"
NODE_KEY, REFUSED_KEY = "draftfeed/node/{}", "draftfeed/refused/{}"
# How long node 0 waits for every other node to join (each says so at once, before it loads anything).
DEFAULT_JOIN_TIMEOUT_S = 120.0


def refusal(store: dist.TCPStore, nodes: NodePlan) -> str | None:
    """What a node that refused to join said (it runs another plan, or another node took its rank), or None."""
    for node in range(1, nodes.nnodes):
        key = REFUSED_KEY.format(node)
        if store.check([key]):
            return store.get(key).decode()
    return None


def await_nodes(store: dist.TCPStore, nodes: NodePlan, timeout_s: float, stopped: Callable[[], str | None] = lambda: None) -> None:
    """Every other node joins ``store`` (node 0's) within ``timeout_s``; one that refused, or that never comes, or
    ``stopped()`` saying why this node stops, is one line: CannotServe."""
    missing = list(range(1, nodes.nnodes))
    deadline = time.monotonic() + timeout_s
    while missing:
        if (why := stopped() or refusal(store, nodes)) is not None:
            raise CannotServe(why)
        missing = [node for node in missing if not store.check([NODE_KEY.format(node)])]
        if not missing:
            return
        if time.monotonic() > deadline:
            waiting = ", ".join(str(node) for node in missing)
            raise CannotServe(
                f"node {waiting} of --nnodes {nodes.nnodes} did not join at {nodes.master} within {timeout_s:.0f} s: run the same "
                f"`draftfeed launch worker` line there with --node-rank {missing[0]}, and check that it reaches --master-addr"
            )
        time.sleep(0.2)


def join_node_zero(nodes: NodePlan, plan: dict[str, Any], timeout_s: float) -> dist.TCPStore:
    """This node (rank ``nodes.node_rank`` > 0) joins node 0's store, says so, and checks ``plan`` against node 0's:
    the store, or CannotServe in one line (also told to node 0 where it has a store to tell)."""
    where = f"node {nodes.node_rank} of --nnodes {nodes.nnodes}"
    try:
        store = dist.TCPStore(nodes.master_host, nodes.master_port, is_master=False, timeout=timedelta(seconds=timeout_s))
    except (RuntimeError, TimeoutError) as exc:
        raise CannotServe(
            f"{where}: no node 0 answered at --master-addr {nodes.master} within {timeout_s:.0f} s ({type(exc).__name__}); start "
            "the worker's node 0 (--node-rank 0) there first, and check that this machine reaches that address"
        ) from None
    if store.add(NODE_KEY.format(nodes.node_rank), 1) > 1:
        _refuse(store, nodes, f"two machines started as --node-rank {nodes.node_rank} of the worker at {nodes.master}: give each its own rank")
    theirs = json.loads(store.get(PLAN_KEY))
    if (difference := describe_difference(plan, theirs, f"node {nodes.node_rank}", "node 0")) is not None:
        _refuse(store, nodes, f"{where} runs another plan than node 0: {difference}; start every node with the same line but --node-rank")
    return store


def _refuse(store: dist.TCPStore, nodes: NodePlan, why: str) -> None:
    """Tell node 0 why this node does not join (it stops with the same line), and stop here."""
    store.set(REFUSED_KEY.format(nodes.node_rank), why)
    raise CannotServe(why)
