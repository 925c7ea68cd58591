"""A rank's settings, checked when the remote target is made: a wrong one is a ValueError naming it, at once,
never a failure on the IO thread later. Each default and description is stated here once (RemoteTarget's parameters
and ``draftfeed demo --prefetch-depth`` read them from here). Importing it loads no torch: the CLI reads it."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, StrictInt, ValidationError

from draftfeed.schemas.messages import DataPlaneMode, VersionPolicy, VersionWanted
from draftfeed.schemas.protocol import DEFAULT_MAX_MESSAGE_BYTES
from draftfeed.schemas.settings import Settings

Seconds = Annotated[float, Field(gt=0)]


class RankSettings(Settings):
    """A rank's settings: RemoteTarget's parameters (and a draftfeed:// URL's options)."""

    prefetch_depth: Annotated[
        StrictInt, Field(ge=0, le=1024, description="batches in flight per rank; the broker caps it (--max-queued-per-rank)")
    ] = 2
    request_timeout: Annotated[Seconds, Field(description="the longest wait for one answer, in seconds")] = 600.0
    connect_timeout: Annotated[Seconds, Field(description="the longest wait for the broker's welcome, in seconds")] = 30.0
    wait_for_workers: Annotated[float, Field(ge=0, description="seconds to wait for a first worker of the service (0: fail at once)")] = 120.0
    wait_log_interval: Annotated[Seconds, Field(description="how often a wait says what it waits for, in seconds")] = 5.0
    data_plane: Annotated[DataPlaneMode, Field(description="how supervision reaches this rank (docs/data-planes.md)")] = "auto"
    max_result_bytes: Annotated[StrictInt, Field(gt=0, description="the largest answer this rank takes")] = DEFAULT_MAX_MESSAGE_BYTES
    device: Annotated[str | None, Field(description="where supervision lands; None: the CPU, as received")] = None
    nixl_pool_bytes: Annotated[StrictInt, Field(gt=0, description="the most receive memory the nixl plane registers (allocated as used)")] = 32 << 30
    metrics_port: Annotated[
        Annotated[StrictInt, Field(gt=0, lt=65536)] | None,
        Field(description="serve GET /health and GET /metrics (Prometheus) on this port, on every interface; None: not served"),
    ] = None
    store: Annotated[str | None, Field(description="the supervision store's folder (docs/store.md); None: no store")] = None
    store_mode: Annotated[
        Literal["record", "replay", "cache"] | None, Field(description="the store's mode: record, replay or cache (None: cache)")
    ] = None
    store_shard_bytes: Annotated[StrictInt, Field(ge=1 << 10, description="the size of one shard file (gathered in memory)")] = 256 << 20
    store_queue_batches: Annotated[StrictInt, Field(ge=1, description="recorded batches waiting for the disk before the loop waits")] = 8
    on_nonfinite: Annotated[
        Literal["raise", "skip"],
        Field(description="a batch whose supervision held NaN or Inf: raise NonFiniteSupervision, or skip it in iterate() (logged, counted)"),
    ] = "raise"
    min_target_version: Annotated[
        StrictInt | None,
        Field(ge=0, description="the oldest version of the target's weights this rank takes (docs/versions.md); None: any"),
    ] = None
    version_policy: Annotated[
        VersionPolicy | None,
        Field(description="which versions it takes: at-least (the default once a version is asked), exact, or latest"),
    ] = None

    @property
    def version_wanted(self) -> VersionWanted | None:
        """What every request says of the target versions it takes; None: any."""
        if self.min_target_version is None and self.version_policy is None:
            return None
        return VersionWanted(minimum=self.min_target_version or 0, policy=self.version_policy or "at-least")

    @classmethod
    def checked(cls, owner: str, **values: object) -> RankSettings:
        """The settings, or a ValueError that names each wrong one and what it takes."""
        import torch

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
        if (problem := settings.store_version_problem(settings.version_wanted)) is not None:
            raise ValueError(f"{owner}: {problem}")
        return settings

    def store_version_problem(self, wanted: VersionWanted | None) -> str | None:
        """Why this rank's store cannot answer for ``wanted``, or None: a cache cannot tell which version is the newest
        among the live workers, so it cannot serve ``latest``."""
        if self.store_mode_in_force == "cache" and wanted is not None and wanted.policy == "latest":
            return (
                "version_policy='latest' with store_mode='cache': the store cannot tell which version is the newest among the "
                "live workers; take version_policy='at-least' with a min_target_version, or record with store_mode='record'"
            )
        return None

    @property
    def store_mode_in_force(self) -> Literal["record", "replay", "cache"] | None:
        """The store's mode: store_mode, or cache when a store is given without one; None without a store."""
        return None if self.store is None else self.store_mode or "cache"

    def check_device(self, owner: str) -> None:
        import torch

        from draftfeed.dataplane.choice import nixl_installed

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
