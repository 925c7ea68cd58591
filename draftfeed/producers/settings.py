"""A rank's settings, checked when the remote target is made: a wrong one is a ValueError naming it, at once,
never a failure on the IO thread later. Each default is stated here once."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError

from draftfeed.dataplane.choice import nixl_installed
from draftfeed.schemas.messages import DataPlaneMode
from draftfeed.schemas.protocol import DEFAULT_MAX_MESSAGE_BYTES

Seconds = Annotated[float, Field(gt=0)]


class RankSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    prefetch_depth: Annotated[StrictInt, Field(ge=0, le=1024)] = 2  # batches in flight; the broker caps it (--max-queued-per-rank)
    request_timeout: Seconds = 600.0  # the longest wait for one answer
    connect_timeout: Seconds = 30.0  # the longest wait for the broker's welcome
    wait_for_workers: Annotated[float, Field(ge=0)] = 120.0  # how long to wait for a first worker of the service (0: fail at once)
    wait_log_interval: Seconds = 5.0  # how often a wait says what it waits for
    data_plane: DataPlaneMode = "auto"
    max_result_bytes: Annotated[StrictInt, Field(gt=0)] = DEFAULT_MAX_MESSAGE_BYTES
    device: str | None = None  # where supervision lands; None: the CPU, as received
    nixl_pool_bytes: Annotated[StrictInt, Field(gt=0)] = 4 << 30  # the most receive memory the nixl plane registers (allocated as used)
    # Serve GET /health and GET /metrics (Prometheus) on this port, on every interface; None: not served.
    metrics_port: Annotated[StrictInt, Field(gt=0, lt=65536)] | None = None
    # The supervision store (docs/store.md): a folder; None: no store. Its mode: "record", "replay" or "cache" (None: cache).
    store: str | None = None
    store_mode: Literal["record", "replay", "cache"] | None = None
    store_shard_bytes: Annotated[StrictInt, Field(ge=1 << 10)] = 256 << 20  # the size of one shard file (gathered in memory)
    store_queue_batches: Annotated[StrictInt, Field(ge=1)] = 8  # recorded batches waiting for the disk before the loop waits

    @classmethod
    def checked(cls, owner: str, **values: object) -> RankSettings:
        """The settings, or a ValueError that names each wrong one and what it takes."""
        if isinstance(values.get("device"), torch.device):
            values["device"] = str(values["device"])
        if isinstance(values.get("store"), Path):
            values["store"] = str(values["store"])
        try:
            settings = cls(**values)
        except ValidationError as exc:
            problems = "; ".join(f"{'.'.join(map(str, e['loc']))}={e.get('input')!r}: {e['msg'].lower()}" for e in exc.errors())
            raise ValueError(f"{owner}: {problems}") from None
        settings.check_device(owner)
        if settings.store_mode is not None and settings.store is None:
            raise ValueError(f"{owner}: store_mode={settings.store_mode!r} needs store=PATH, the store's folder")
        return settings

    @property
    def store_mode_in_force(self) -> Literal["record", "replay", "cache"] | None:
        """The store's mode: store_mode, or cache when a store is given without one; None without a store."""
        return None if self.store is None else self.store_mode or "cache"

    def check_device(self, owner: str) -> None:
        device = torch.device(self.device) if self.device is not None else torch.device("cpu")
        if device.type == "cuda" and not torch.cuda.is_available():
            why = "torch here is built without CUDA" if torch.version.cuda is None else "no CUDA device is visible"
            raise ValueError(f"{owner}: device={self.device!r}, but {why}: pass device='cpu' (or None) on this machine")
        if self.data_plane == "nixl" and not nixl_installed():
            raise ValueError(f"{owner}: data_plane='nixl', but NIXL is not installed here: pip install 'draftfeed[nixl]', or use data_plane='auto'")
        if self.data_plane == "nccl" and device.type != "cuda":
            raise ValueError(
                f"{owner}: data_plane='nccl' needs a CUDA device= to receive on, and this rank's device is {device}: "
                "use data_plane='auto' (NCCL where it can be had, frames elsewhere) or 'frames'"
            )
