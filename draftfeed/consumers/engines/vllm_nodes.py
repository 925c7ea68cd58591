"""vllm over machines (``--engine vllm --tensor-parallel N --nnodes M``): vLLM's own multi-node executor, its ranks
placed as vLLM's ``--nnodes/--node-rank/--master-addr/--master-port`` place them, node 0 serving and the others
headless. draftfeed's rendezvous (parallel/rendezvous.py) comes first: every node checks its plan against node 0's
before vLLM starts anywhere, and node 0's store carries node 0's vLLM arguments to the others, which cannot work
them out themselves (the capture's layer ids are known once the task prepares the engine).

- Node 0 (``NodeZero``, in the worker's VLLMEngine) hosts the store at --master-addr, waits for every node, picks
  vLLM's own port on the same address, publishes the vLLM arguments as the task prepares the capture, then starts
  vLLM at node rank 0; on close it says so in the store.
- Node R (``serve_vllm_node``, ``draftfeed launch worker ... --node-rank R``) waits for those arguments, starts vLLM's
  headless ``MultiprocExecutor`` at node rank R with its own --target path, and ends when node 0 says it closed,
  when node 0 falls silent for WATCH_SILENCE_S (node 0 lost), when one of its vLLM processes dies, or on
  SIGTERM / SIGINT. A headless vLLM node does not end by itself when node 0 does.
- Liveness, apart from vLLM's collectives (watch.py): node R says it is alive to node 0's watch once a second. A node
  that falls silent (its host down, its link cut, its processes killed) makes node 0 stop the worker within
  WATCH_SILENCE_S (``on_silent``: the engine's loss, loss.py), where vLLM would wait for its own timeout (300 s) in
  a collective that never ends.
- On both, vLLM is told the address (``VLLM_HOST_IP``) and gloo and NCCL the interface towards node 0, unless the user
  set them: on a host without a default route vLLM otherwise takes 0.0.0.0 ("Failed to get the IP address") and the
  nodes hang.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from draftfeed.consumers.engines.parallel.group import INTERFACE_VARIABLES, LOAD_TIMEOUT_S, address_towards, host_rendezvous, interface_towards
from draftfeed.consumers.engines.parallel.rendezvous import PLAN_KEY, await_nodes
from draftfeed.consumers.engines.parallel.watch import FollowerWatch, LeaderWatch, stop_on_signals
from draftfeed.consumers.engines.vllm_environment import cpu_start_environment, environment
from draftfeed.consumers.nodes import NodePlan
from draftfeed.net import free_port
from draftfeed.schemas.errors import CannotServe

log = logging.getLogger("draftfeed.worker")

ARGUMENTS_KEY, CLOSED_KEY, WATCH_KEY = "draftfeed/vllm/arguments", "draftfeed/vllm/closed", "draftfeed/vllm/watch"


def node_environment(master_host: str) -> dict[str, str]:
    """What vLLM, gloo and NCCL are told on a node: its address and interface towards node 0 (``master_host``), each
    unless the user set it already (as for the other engines' processes: group.use_interface)."""
    address, interface = address_towards(master_host), interface_towards(master_host)
    if address is None:
        raise ValueError(f"--master-addr {master_host}: this machine has no route to it; give node 0's address on the network the nodes share")
    chosen = {"VLLM_HOST_IP": address} | ({variable: interface for variable in INTERFACE_VARIABLES} if interface is not None else {})
    return {variable: value for variable, value in chosen.items() if variable not in os.environ}


class NodeZero:
    """Node 0's side: the store the other nodes join, vLLM's own meeting port, and the watch that hears every other
    node (``on_silent`` when one falls silent)."""

    def __init__(self, nodes: NodePlan, plan: dict[str, Any] | None, join_timeout_s: float, on_silent: Callable[[str], None]) -> None:
        self.nodes = nodes
        self.store = host_rendezvous(LOAD_TIMEOUT_S, nodes.master_host, nodes.master_port)
        self.watch = LeaderWatch(f"tcp://{nodes.master_host}:*", on_silent)
        try:
            self.store.set(PLAN_KEY, json.dumps(plan or {}))
            self.store.set(WATCH_KEY, self.watch.endpoint)
            await_nodes(self.store, nodes, join_timeout_s)
        except BaseException:
            self.watch.close()
            raise
        log.info("worker: every node of %d joined at %s", nodes.nnodes, nodes.master)
        self.vllm_port = free_port(nodes.master_host)

    def placement(self) -> dict[str, Any]:
        """vLLM's arguments that place node 0's ranks among every node's."""
        return {
            "nnodes": self.nodes.nnodes,
            "node_rank": 0,
            "master_addr": self.nodes.master_host,
            "master_port": self.vllm_port,
            "distributed_executor_backend": "mp",
        }

    def environment(self) -> dict[str, str]:
        return node_environment(self.nodes.master_host)

    def publish(self, arguments: dict[str, Any]) -> None:
        """Node 0's vLLM arguments, for the other nodes (each puts its own --target path and node rank in)."""
        self.store.set(ARGUMENTS_KEY, json.dumps({key: value for key, value in arguments.items() if key != "model"}))

    def close(self) -> None:
        """Tell the other nodes that node 0 closed vLLM: they stop theirs (their silence is expected from here)."""
        self.watch.close()
        try:
            self.store.set(CLOSED_KEY, "1")
        except Exception:  # a store that is already gone says it too
            pass


def serve_vllm_node(settings: Any, store: dist.TCPStore, nodes: NodePlan, on_ready: Any = None) -> int:
    """Node R's vLLM: headless, at node rank R, with node 0's arguments and this node's --target path, until node 0
    closes (0) or is lost, or a vLLM process here dies, or a signal (CannotServe, or 0 on a signal)."""
    where = f"node {nodes.node_rank} of --nnodes {nodes.nnodes}"
    arguments = _await_arguments(store, where, LOAD_TIMEOUT_S)
    arguments |= {"model": settings.path, "node_rank": nodes.node_rank}
    variables = node_environment(nodes.master_host)
    if settings.device.startswith("cpu"):
        variables |= cpu_start_environment(nodes.per_node)
    elif settings.devices:  # this machine's GPUs for its vLLM ranks, as node 0's engine shows them to vLLM
        variables["CUDA_VISIBLE_DEVICES"] = ",".join(device.rpartition(":")[2] for device in settings.devices)
    log.info(
        "%s: starting vLLM's headless executor for ranks %s (%s)", where, list(nodes.ranks()), ", ".join(f"{k}={v}" for k, v in variables.items())
    )
    ended = threading.Event()
    stop = stop_on_signals(ended)
    silent: list[str] = []
    closed = threading.Event()

    def node_zero_silent(why: str) -> None:
        silent.append(why)
        ended.set()

    ranks = nodes.ranks()
    beats = FollowerWatch(
        store.get(WATCH_KEY).decode(),
        ranks[0],
        nodes.node_rank,
        socket.gethostname(),
        what=f"vLLM node {nodes.node_rank} ({f'rank {ranks[0]}' if len(ranks) == 1 else f'ranks {ranks[0]}-{ranks[-1]}'})",
        on_silent=node_zero_silent,
    )
    try:
        with environment(variables):
            executor = _headless_executor(arguments)
        if on_ready is not None:
            on_ready()
        _watch_closed(store, closed, ended)
        try:
            failed = _await_end(executor, ended)
        finally:
            executor.shutdown()
    finally:
        beats.close()
    if stop:
        log.info("%s: %s: vLLM stopped here", where, stop[0])
        return 0
    if closed.is_set():
        log.info("%s: node 0 closed vLLM; vLLM stopped here", where)
        return 0
    raise CannotServe(f"{where}: {failed or silent[0]}; vLLM stopped here")


def _await_arguments(store: dist.TCPStore, where: str, timeout_s: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if store.check([ARGUMENTS_KEY]):
                return json.loads(store.get(ARGUMENTS_KEY))
        except Exception as exc:  # node 0 gone before it started vLLM
            raise CannotServe(f"{where}: node 0 ended before it started vLLM ({type(exc).__name__})") from None
        if time.monotonic() > deadline:
            raise CannotServe(f"{where}: node 0 did not start vLLM within {timeout_s:.0f} s")
        time.sleep(0.2)


def _headless_executor(arguments: dict[str, Any]) -> Any:
    """vLLM's multiprocess executor of this node's ranks, as ``vllm serve --headless`` starts it (its workers monitored:
    one that dies marks it failed)."""
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor

    arguments = dict(arguments)
    if isinstance(arguments.get("kv_transfer_config"), dict):
        arguments["kv_transfer_config"] = KVTransferConfig(**arguments["kv_transfer_config"])
    config = EngineArgs(**arguments).create_engine_config(UsageContext.OPENAI_API_SERVER, headless=True)
    executor = MultiprocExecutor(config, monitor_workers=False)
    executor.start_worker_monitor()
    return executor


def _watch_closed(store: dist.TCPStore, closed: threading.Event, ended: threading.Event) -> None:
    """Node 0's word that it closed vLLM (``closed``, then ``ended``), read from its store on a thread of its own: a
    store call to a machine whose link is cut blocks for the store's whole timeout, and node 0's silence must end this
    node sooner (the watch)."""

    def read() -> None:
        while not ended.is_set():
            try:
                if store.check([CLOSED_KEY]):
                    closed.set()
                    ended.set()
                    return
            except Exception:  # node 0's store does not answer: its silence, if it lasts, ends this node
                pass
            ended.wait(1.0)

    threading.Thread(target=read, name="draftfeed-vllm-closed", daemon=True).start()


def _await_end(executor: Any, ended: threading.Event) -> str | None:
    """Wait until ``ended`` (node 0 closed or fell silent, or a signal: None), or why this node must stop."""
    while not ended.wait(1.0):
        if getattr(executor, "is_failed", False):
            return "a vLLM process on this node ended"
    return None
