"""The process group of one tensor-parallel worker: NCCL on GPUs, gloo on CPU, met at rank 0's TCPStore: on loopback
when the worker is on one machine, on node 0's --master-addr when it spans several (then gloo and NCCL use the
interface that routes there, never loopback)."""

from __future__ import annotations

import fcntl
import os
import socket
import struct
from datetime import timedelta

import torch
import torch.distributed as dist

from draftfeed.consumers.engines.parallel.spec import LOOPBACK, ProcessPlace

# A collective that waits longer than this for a peer fails (a dead follower usually fails it at once, by a closed
# connection). It bounds a forward of the longest row, so it is generous; a node that is lost is found sooner by the
# worker's watch (watch.py).
COLLECTIVE_TIMEOUT_S = 600.0
# Every rank of a worker joins the group and loads its shard of the target within this.
LOAD_TIMEOUT_S = 1800.0
SIOCGIFADDR = 0x8915


def host_rendezvous(timeout_s: float, host: str = LOOPBACK, port: int = 0) -> dist.TCPStore:
    """Rank 0's store on ``host:port`` (a free port of 127.0.0.1 by default; ``store.port``), returned without waiting
    for the others. A port that is taken is a ValueError naming it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, port))
        listener.listen(128)
        port = listener.getsockname()[1]
    except OSError as exc:
        listener.close()
        where = f"{host}:{port}" if port else host
        raise ValueError(f"--master-addr {where}: cannot listen there ({exc.strerror}); give an address of node 0 and a free port") from None
    return dist.TCPStore(
        host,
        port,
        world_size=None,
        is_master=True,
        timeout=timedelta(seconds=timeout_s),
        wait_for_workers=False,
        master_listen_fd=listener.detach(),
    )


def address_towards(host: str) -> str | None:
    """This machine's address that routes to ``host`` (the kernel's choice, asked with an unconnected UDP socket: no
    packet is sent), None without a route."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((host, 9))
        except OSError:
            return None
        return probe.getsockname()[0]


def interface_towards(host: str) -> str | None:
    """The name of this machine's network interface that routes to ``host``, None if no interface holds the address
    it routes from."""
    local = address_towards(host)
    if local is None or ":" in host:
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as ask:
        for _index, name in socket.if_nameindex():
            try:
                answer = fcntl.ioctl(ask.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
            if socket.inet_ntoa(answer[20:24]) == local:
                return name
    return None


# What gloo and NCCL read to bind to a network interface.
INTERFACE_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def use_interface(place: ProcessPlace) -> None:
    """gloo and NCCL bind to the interface towards node 0 (unless the user named one already)."""
    if place.interface is not None:
        for variable in INTERFACE_VARIABLES:
            os.environ.setdefault(variable, place.interface)


def join_process_group(place: ProcessPlace, timeout_s: float) -> torch.device:
    """Make this process rank ``place.rank`` of the default process group, bound to its device, which it returns.

    transformers binds a process to the accelerator ``LOCAL_RANK`` names: that is the device's index here.
    """
    device = torch.device(place.device)
    if device.type != "cpu":
        os.environ["LOCAL_RANK"] = str(device.index)
        torch.accelerator.set_device_index(device.index)
    use_interface(place)
    store = place.store
    if store is None:
        store = dist.TCPStore(place.store_host, place.store_port, is_master=False, timeout=timedelta(seconds=timeout_s))
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend,
        store=dist.PrefixStore("group/", store),
        rank=place.rank,
        world_size=place.world_size,
        timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
        device_id=device if backend == "nccl" else None,
    )
    return device
