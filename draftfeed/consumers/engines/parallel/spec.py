"""Where one process of a tensor-parallel worker stands: its rank in the worker's process group (torch.distributed's
rank, never a training rank), on which machine and device, and where they all meet."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import Field

from draftfeed.schemas.messages import Name, Strict

LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class ProcessPlace:
    """Process-group rank ``rank`` (torch.distributed's) of ``world_size`` processes, on ``device`` (``local_rank`` among its machine's). The group meets
    at the TCPStore rank 0 hosts (``store``, rank 0's alone) on ``store_host:store_port``: 127.0.0.1 on one machine,
    node 0's --master-addr across several. An engine that sets up its own group instead (sglang's ModelRunner) meets
    on ``engine_port`` of ``store_host``. ``interface``: the network interface towards ``store_host`` across
    machines (gloo and NCCL bind to it), None on one."""

    rank: int
    world_size: int
    device: str
    store_port: int
    engine_port: int
    store_host: str = LOOPBACK
    local_rank: int = 0
    nnodes: int = 1
    node_rank: int = 0
    interface: str | None = None
    store: Any = None


class TargetSpec(Strict):
    """What every rank builds: the engine and target, the same on every process of the worker."""

    engine: str
    target: str
    dtype: str
    options: dict[str, Any] = {}
    expert_parallel: bool = False


class Meeting(Strict):
    """Where the worker's processes meet, as rank 0 hosts it: its store, sglang's port, where its calls come from
    (``channel``) and where each process says it is alive (``watch``). Across machines rank 0 publishes it in its
    store, for the other nodes (node.py)."""

    world_size: Annotated[int, Field(ge=2)]
    nnodes: Annotated[int, Field(ge=1)] = 1
    store_host: Name = LOOPBACK
    store_port: Annotated[int, Field(gt=0, lt=65536)]
    engine_port: Annotated[int, Field(gt=0, lt=65536)]
    channel: Name
    watch: Name


class FollowerSpec(Strict):
    """What a follower process is started with (one JSON argument): what to build, where to meet, and its place there.
    ``interface``: its machine's interface towards node 0 (None on one machine); ``parent_pid``: the process it dies
    with (the worker, or its node's agent on the other machines)."""

    target: TargetSpec
    meeting: Meeting
    rank: Annotated[int, Field(ge=1)]
    local_rank: Annotated[int, Field(ge=0)]
    node_rank: Annotated[int, Field(ge=0)] = 0
    device: Name
    interface: Name | None = None
    parent_pid: Annotated[int, Field(gt=0)]

    def place(self) -> ProcessPlace:
        return place_at(self.meeting, self.rank, self.device, self.local_rank, self.node_rank, self.interface)


def place_at(
    meeting: Meeting, rank: int, device: str, local_rank: int = 0, node_rank: int = 0, interface: str | None = None, store: Any = None
) -> ProcessPlace:
    """Rank ``rank``'s place at ``meeting`` (rank 0 passes the ``store`` it hosts)."""
    return ProcessPlace(
        rank=rank,
        world_size=meeting.world_size,
        device=device,
        store_port=meeting.store_port,
        engine_port=meeting.engine_port,
        store_host=meeting.store_host,
        local_rank=local_rank,
        nnodes=meeting.nnodes,
        node_rank=node_rank,
        interface=interface,
        store=store,
    )
