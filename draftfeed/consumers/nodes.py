"""Where the processes of one worker live when its target spans several machines (pure: no torch, no processes).

One worker is one replica of the target over ``tensor_parallel`` processes, ``tensor_parallel / nnodes`` of them on
each of ``nnodes`` machines. Every machine runs the same ``draftfeed launch worker`` line with its own
``--node-rank``: node 0 is the worker (it registers with the broker and answers the ranks) and hosts the rendezvous
at ``--master-addr``; every other node starts its share of the processes and talks to no broker. The nodes check
that they run the same plan (``fingerprint``) before any of them loads the target.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

_ADDRESS = re.compile(r"^(?P<host>\[[0-9a-fA-F:]+\]|[A-Za-z0-9_.-]+):(?P<port>\d{1,5})$")


@dataclass(frozen=True)
class NodePlan:
    """This node's place: ``node_rank`` of ``nnodes``, meeting at ``master_host:master_port`` (node 0's)."""

    nnodes: int
    node_rank: int
    master_host: str
    master_port: int
    tensor_parallel: int

    @property
    def per_node(self) -> int:
        """Processes on each node."""
        return self.tensor_parallel // self.nnodes

    @property
    def first_rank(self) -> int:
        """The global rank of this node's first process."""
        return self.node_rank * self.per_node

    def ranks(self) -> range:
        """The global ranks of this node's processes."""
        return range(self.first_rank, self.first_rank + self.per_node)

    @property
    def master(self) -> str:
        return f"{self.master_host}:{self.master_port}"


def node_plan(nnodes: int, node_rank: int, master_addr: str | None, tensor_parallel: int, devices: int) -> NodePlan | None:
    """The node plan of these flags (None for a worker on one machine); a ValueError names the flag to change.
    ``devices``: how many devices --devices names on this node (0: none named)."""
    if nnodes < 1:
        raise ValueError(f"--nnodes {nnodes}: give the number of machines one worker spans, at least 1")
    if not 0 <= node_rank < nnodes:
        raise ValueError(f"--node-rank {node_rank}: give this machine's place among the --nnodes {nnodes}, from 0 to {nnodes - 1}")
    if nnodes == 1:
        if master_addr is not None:
            raise ValueError("--master-addr goes with --nnodes 2 or more: a worker on one machine meets its processes on loopback")
        return None
    if master_addr is None:
        raise ValueError(f"--nnodes {nnodes} needs --master-addr HOST:PORT: where node 0 listens for the other nodes (node 0's address)")
    match = _ADDRESS.match(master_addr)
    if match is None or not 0 < int(match.group("port")) < 65536:
        raise ValueError(f"--master-addr {master_addr!r}: write HOST:PORT, node 0's address and a free port there, like 10.0.0.5:29500")
    host = match.group("host").strip("[]")
    if host in ("127.0.0.1", "localhost", "::1") or host.startswith("127."):
        raise ValueError(f"--master-addr {master_addr}: the other nodes cannot reach a loopback address; give node 0's address on their network")
    if tensor_parallel % nnodes:
        raise ValueError(f"--tensor-parallel {tensor_parallel} does not split over --nnodes {nnodes}: give a multiple of {nnodes}")
    if devices and devices != tensor_parallel // nnodes:
        raise ValueError(
            f"--devices names {devices} devices; across --nnodes {nnodes} each node runs {tensor_parallel // nnodes} of the "
            f"--tensor-parallel {tensor_parallel} processes: name this node's {tensor_parallel // nnodes}"
        )
    return NodePlan(nnodes, node_rank, host, int(match.group("port")), tensor_parallel)


def fingerprint(target: str, engine: str, dtype: str, task_flags: dict[str, object], tensor_parallel: int, nnodes: int) -> dict[str, object]:
    """What every node of one worker must agree on: the target (its config, wherever it lies on each machine),
    the engine, dtype and degree. ``describe_difference`` says which field differs."""
    config = Path(target) / "config.json"
    digest = hashlib.blake2b(config.read_bytes(), digest_size=8).hexdigest() if config.is_file() else f"id:{target}"
    return {
        "target_config": digest,
        "target": target,
        "engine": engine,
        "dtype": dtype,
        "tensor_parallel": tensor_parallel,
        "nnodes": nnodes,
        **{key: task_flags[key] for key in sorted(task_flags)},
    }


def describe_difference(ours: dict[str, object], theirs: dict[str, object], we: str, they: str) -> str | None:
    """The fields in which two fingerprints differ, each with both values; None when they agree. The target's path
    may differ between machines: only its config counts."""
    differences = [
        f"{name} {json.dumps(ours.get(name))} on {we}, {json.dumps(theirs.get(name))} on {they}"
        for name in sorted(set(ours) | set(theirs))
        if name != "target" and ours.get(name) != theirs.get(name)
    ]
    if not differences:
        return None
    if "target_config" in {name for name in set(ours) | set(theirs) if ours.get(name) != theirs.get(name)}:
        differences.append(f"(targets {ours.get('target')} and {theirs.get('target')})")
    return "; ".join(differences)
