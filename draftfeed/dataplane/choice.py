"""Which data plane a (worker, rank) pair uses, and why: a pure function of the two sides' offers.

``auto`` on both sides picks NCCL only when it can work and pays: both processes on one machine (the same
kernel boot id, not just the same hostname string), both holding CUDA tensors, NCCL present on both, and
not one GPU (NCCL refuses two ranks on one device). Anything else is frames. ``frames`` on either side
wins; ``gloo`` or ``nccl`` on one side forces that backend when the other side is ``auto`` or agrees. A forced
plane that cannot be had (the sides force different ones, or NCCL without CUDA on both) is refused: the pair's
requests fail with the reason, so that a forced setting never silently becomes another; only ``auto`` falls back.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from draftfeed.schemas.messages import DataPlaneMode, DataPlaneOffer

Plane = Literal["frames", "nccl", "gloo"]
MODES: tuple[DataPlaneMode, ...] = ("auto", "frames", "nccl", "gloo")
_BOOT_ID = Path("/proc/sys/kernel/random/boot_id")
_MACHINE_ID = Path("/etc/machine-id")


@dataclass(frozen=True)
class PlaneChoice:
    plane: Plane
    reason: str
    refused: bool = False  # a forced plane that cannot be had: the pair's requests fail with the reason


def host_id() -> str:
    """This machine's identity: the kernel's boot id (shared by every container on the machine, different on
    every other machine), else /etc/machine-id, else the hostname."""
    for path in (_BOOT_ID, _MACHINE_ID):
        try:
            value = path.read_text().strip()
        except OSError:
            continue
        if value:
            return value
    return socket.gethostname()


def local_offer(mode: str, device: torch.device | str | None) -> DataPlaneOffer:
    """This process's offer for ``mode``, with supervision produced on (worker) or wanted on (rank) ``device``."""
    if mode not in MODES:
        raise ValueError(f"data plane {mode!r} is not one of {', '.join(MODES)}")
    device = torch.device(device if device is not None else "cpu")
    uuid = None
    if device.type == "cuda" and torch.cuda.is_available():
        index = device.index if device.index is not None else torch.cuda.current_device()
        uuid = str(torch.cuda.get_device_properties(index).uuid)
        device = torch.device("cuda", index)
    nccl = bool(torch.distributed.is_available() and torch.distributed.is_nccl_available() and torch.cuda.is_available())
    return DataPlaneOffer(mode=mode, host_id=host_id(), hostname=socket.gethostname(), device=str(device), gpu_uuid=uuid, nccl=nccl)


def choose_plane(worker: DataPlaneOffer, rank: DataPlaneOffer | None) -> PlaneChoice:
    """The plane for supervision from ``worker`` to ``rank``, with the reason in words."""
    if rank is None:
        return PlaneChoice("frames", "the rank offers no data plane but frames")
    modes = {"worker": worker.mode, "rank": rank.mode}
    for side, mode in modes.items():
        if mode == "frames":
            return PlaneChoice("frames", f"the {side} asks for frames")
    forced = {side: mode for side, mode in modes.items() if mode != "auto"}
    if len(set(forced.values())) > 1:
        return PlaneChoice("frames", f"the worker asks for {worker.mode} and the rank for {rank.mode}", refused=True)
    if "gloo" in forced.values():
        sides = " and ".join(forced)
        return PlaneChoice("gloo", f"the {sides} asked for gloo")
    asked = f"the {' and '.join(forced)} asked for nccl" if forced else "auto"
    if not forced and worker.host_id != rank.host_id:
        return PlaneChoice("frames", f"auto: the rank is on another machine ({rank.hostname}, worker on {worker.hostname})")
    refused = bool(forced)
    for side, offer in (("worker", worker), ("rank", rank)):
        if not offer.device.startswith("cuda"):
            return PlaneChoice("frames", f"{asked}, but the {side}'s supervision is on {offer.device}, not a CUDA device", refused)
        if not offer.nccl:
            return PlaneChoice("frames", f"{asked}, but torch on the {side} has no NCCL", refused)
    if worker.gpu_uuid is not None and worker.gpu_uuid == rank.gpu_uuid:
        return PlaneChoice("frames", f"{asked}, but worker and rank share one GPU ({worker.gpu_uuid}), where NCCL refuses two ranks", refused)
    where = "one machine" if worker.host_id == rank.host_id else f"{worker.hostname} and {rank.hostname}"
    return PlaneChoice("nccl", f"{asked}: both on {where} with CUDA (worker {worker.device}, rank {rank.device})")
