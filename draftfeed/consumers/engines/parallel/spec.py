"""Where one process of a tensor-parallel worker stands: its rank among the worker's processes and their devices."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import Field

from draftfeed.schemas.messages import Strict


@dataclass(frozen=True)
class ParallelRank:
    """Rank ``rank`` of ``len(devices)`` processes, on ``devices[rank]``; the group meets at a TCPStore on
    127.0.0.1:``rendezvous_port`` that rank 0 hosts (``store``, rank 0's alone). An engine that sets up its own
    group instead (sglang's ModelRunner) meets on ``engine_port``, free on 127.0.0.1 when the worker started."""

    rank: int
    devices: tuple[str, ...]
    rendezvous_port: int
    engine_port: int
    store: Any = None

    @property
    def world_size(self) -> int:
        return len(self.devices)

    @property
    def device(self) -> str:
        return self.devices[self.rank]


class FollowerSpec(Strict):
    """What a follower process is started with (one JSON argument): the engine to build and its place."""

    engine: str
    target: str
    dtype: str
    options: dict[str, Any] = {}
    rank: Annotated[int, Field(ge=1)]
    devices: list[str]
    rendezvous_port: Annotated[int, Field(gt=0, lt=65536)]
    engine_port: Annotated[int, Field(gt=0, lt=65536)]
    channel: str
    leader_pid: Annotated[int, Field(gt=0)]

    def place(self) -> ParallelRank:
        return ParallelRank(rank=self.rank, devices=tuple(self.devices), rendezvous_port=self.rendezvous_port, engine_port=self.engine_port)
