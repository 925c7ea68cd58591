"""Which data plane a (worker, rank) pair uses, and why: a pure function of the two sides' offers.

``auto`` on both sides picks NCCL when it can work and pays: both processes on one machine (the same kernel
boot id, not just the same hostname string), both holding CUDA tensors, NCCL present on both, and not one
GPU (NCCL refuses two ranks on one device). Otherwise it picks NIXL when both sides have it, except between
machines under --secure (NIXL traffic is not encrypted; frames are). Anything else is frames.

One machine is one boot id. Network namespaces (containers, or the tests' "hosts") share the boot id: two
processes in different namespaces of one machine are on one machine, which is true of their GPUs and
memory, so NCCL may be chosen between them; the reason names the separate namespaces, and the sockets
between them are the routed addresses of their own namespaces (UCX picks its transports the same way).

``frames`` on either side wins; ``gloo``, ``nccl`` or ``nixl`` on one side forces that plane when the other
side is ``auto`` or agrees. A forced plane that cannot be had (the sides force different ones, NCCL without
CUDA on both, NIXL missing on one side) is refused: the pair's requests fail with the reason, so that a
forced setting never silently becomes another; only ``auto`` falls back.
"""

from __future__ import annotations

import importlib.util
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from draftfeed.schemas.messages import DataPlaneMode, DataPlaneOffer

Plane = Literal["frames", "nccl", "gloo", "nixl"]
MODES: tuple[DataPlaneMode, ...] = ("auto", "frames", "nccl", "gloo", "nixl")
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


def network_namespace() -> str:
    """This process's network namespace (its inode), or "" where /proc does not say."""
    try:
        return os.readlink("/proc/self/ns/net")
    except OSError:
        return ""


def nixl_installed() -> bool:
    """Whether the NIXL package is installed (cheap: it is loaded only when a nixl pair opens)."""
    return importlib.util.find_spec("nixl_cu12") is not None


def gpu_uuid(device: torch.device) -> str | None:
    """The GPU's UUID (one physical device, however it is numbered in a process), or None off a GPU."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    return str(torch.cuda.get_device_properties(index).uuid)


def local_offer(mode: str, device: torch.device | str | None, encrypted: bool = False) -> DataPlaneOffer:
    """This process's offer for ``mode``, with supervision produced on (worker) or wanted on (rank) ``device``;
    ``encrypted``: this side's data socket is CURVE."""
    if mode not in MODES:
        raise ValueError(f"data plane {mode!r} is not one of {', '.join(MODES)}")
    device = torch.device(device if device is not None else "cpu")
    uuid = gpu_uuid(device)
    if uuid is not None:
        device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
    nccl = bool(torch.distributed.is_available() and torch.distributed.is_nccl_available() and torch.cuda.is_available())
    return DataPlaneOffer(
        mode=mode,
        host_id=host_id(),
        hostname=socket.gethostname(),
        device=str(device),
        gpu_uuid=uuid,
        nccl=nccl,
        nixl=nixl_installed(),
        network=network_namespace(),
        encrypted=encrypted,
    )


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
    sides = " and ".join(forced)
    if "gloo" in forced.values():
        return PlaneChoice("gloo", f"the {sides} asked for gloo")
    if "nixl" in forced.values():
        return _nixl(worker, rank, f"the {sides} asked for nixl", refused=True)
    if forced:
        return _nccl(worker, rank, f"the {sides} asked for nccl", refused=True)
    nccl = _nccl(worker, rank, "auto", refused=False)
    if nccl.plane == "nccl":
        return nccl
    if worker.host_id != rank.host_id and (worker.encrypted or rank.encrypted):
        return PlaneChoice("frames", "auto under --secure between machines: NIXL traffic is not encrypted, frames are (force nixl to use it anyway)")
    nixl = _nixl(worker, rank, "auto", refused=False)
    return nixl if nixl.plane == "nixl" else PlaneChoice("frames", f"{nccl.reason}; {nixl.reason.removeprefix('auto, but ')}")


def _where(worker: DataPlaneOffer, rank: DataPlaneOffer) -> str:
    if worker.host_id != rank.host_id:
        return f"{worker.hostname} and {rank.hostname}"
    if worker.network and rank.network and worker.network != rank.network:
        return "one machine, in separate network namespaces"
    return "one machine"


def _nccl(worker: DataPlaneOffer, rank: DataPlaneOffer, asked: str, refused: bool) -> PlaneChoice:
    if not refused and worker.host_id != rank.host_id:
        return PlaneChoice("frames", f"auto: no nccl, the rank is on another machine ({rank.hostname}, worker on {worker.hostname})")
    for side, offer in (("worker", worker), ("rank", rank)):
        if not offer.device.startswith("cuda"):
            return PlaneChoice("frames", f"{asked}, but the {side}'s supervision is on {offer.device}, not a CUDA device", refused)
        if not offer.nccl:
            return PlaneChoice("frames", f"{asked}, but torch on the {side} has no NCCL", refused)
    if worker.gpu_uuid is not None and worker.gpu_uuid == rank.gpu_uuid:
        return PlaneChoice("frames", f"{asked}, but worker and rank share one GPU ({worker.gpu_uuid}), where NCCL refuses two ranks", refused)
    return PlaneChoice("nccl", f"{asked}: both on {_where(worker, rank)} with CUDA (worker {worker.device}, rank {rank.device})")


def _nixl(worker: DataPlaneOffer, rank: DataPlaneOffer, asked: str, refused: bool) -> PlaneChoice:
    for side, offer in (("worker", worker), ("rank", rank)):
        if not offer.nixl:
            return PlaneChoice("frames", f"{asked}, but the {side} has no NIXL (pip install 'draftfeed[nixl]')", refused)
    return PlaneChoice("nixl", f"{asked}: both have NIXL, on {_where(worker, rank)} (worker {worker.device}, rank {rank.device})")
