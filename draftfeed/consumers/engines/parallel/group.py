"""The process group of one tensor-parallel worker: NCCL on GPUs, gloo on CPU, met at a TCPStore on loopback."""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist

from draftfeed.consumers.engines.parallel.spec import ParallelRank

# A collective that waits longer than this for a peer fails (a dead follower usually fails it at once, by a closed
# connection). It bounds a forward of the longest row, so it is generous.
COLLECTIVE_TIMEOUT_S = 600.0
# Every rank of a worker joins the group and loads its shard of the target within this.
LOAD_TIMEOUT_S = 1800.0


def host_rendezvous(world_size: int, timeout_s: float) -> dist.TCPStore:
    """Rank 0's store on a free port of 127.0.0.1 (``store.port``), returned without waiting for the others."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.bind(("127.0.0.1", 0))
        listener.listen(world_size)
        port = listener.getsockname()[1]
    except OSError:
        listener.close()
        raise
    return dist.TCPStore(
        "127.0.0.1",
        port,
        world_size=world_size,
        is_master=True,
        timeout=timedelta(seconds=timeout_s),
        wait_for_workers=False,
        master_listen_fd=listener.detach(),
    )


def join_process_group(place: ParallelRank, timeout_s: float) -> torch.device:
    """Make this process rank ``place.rank`` of the default process group, bound to its device, which it returns.

    transformers binds a process to the accelerator ``LOCAL_RANK`` names: that is the device's index here.
    """
    device = torch.device(place.device)
    if device.type != "cpu":
        os.environ["LOCAL_RANK"] = str(device.index)
        torch.accelerator.set_device_index(device.index)
    store = place.store
    if store is None:
        store = dist.TCPStore("127.0.0.1", place.rendezvous_port, world_size=place.world_size, is_master=False, timeout=timedelta(seconds=timeout_s))
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend,
        store=store,
        rank=place.rank,
        world_size=place.world_size,
        timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
        device_id=device if backend == "nccl" else None,
    )
    return device
