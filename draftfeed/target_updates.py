"""Updating a service's target weights in place (docs/versions.md): the client side of ``update_target``, for
``draftfeed target update`` and for an RL trainer's own process.

The broker tells every worker of the service below the new version to load the weights, and answers once each has said
how it went: ``update_target`` names a path on the workers' filesystem (a safetensors file, or a folder of them);
``publish_weights`` serves tensors from this process's memory, which each worker pulls in pieces
(dataplane/weights/).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import zmq
from pydantic import ValidationError

from draftfeed.net import local_address_towards
from draftfeed.schemas.errors import RemoteTargetError, RemoteTargetTimeout, UsageError
from draftfeed.schemas.frames import pack, unpack
from draftfeed.schemas.messages import FRONTEND_OUTBOUND, ErrorReply, UpdateReport, UpdateTarget, WorkerKeys
from draftfeed.schemas.protocol import DEFAULT_TRANSFER_CHUNK_BYTES
from draftfeed.schemas.settings import problems
from draftfeed.security.curve import PeerKeys, make_client

if TYPE_CHECKING:
    import torch


def update_target(
    broker: str,
    service: str,
    weights: str,
    target_version: int,
    timeout_s: float = 600.0,
    keys: PeerKeys | None = None,
    at_once: int | None = None,
) -> UpdateReport:
    """Every worker of ``service`` at the broker's rank endpoint ``broker`` loads ``weights`` and serves them as
    ``target_version``, ``at_once`` at a time (None: all together); the report says how each went. Raises
    RemoteTargetError when the broker refuses (no such service), RemoteTargetTimeout when no report comes within
    ``timeout_s``."""
    return _update(broker, _request(service=service, weights=weights, target_version=target_version, at_once=at_once), timeout_s, keys)


def _request(**fields: object) -> UpdateTarget:
    """The update asked for; a UsageError in one line naming each wrong argument (a version below 0, at_once 0)."""
    try:
        return UpdateTarget(request_id=0, **fields)
    except ValidationError as exc:
        raise UsageError(f"the update cannot be asked for: {problems(exc)}") from None


def _update(
    broker: str, request: UpdateTarget, timeout_s: float, keys: PeerKeys | None, on_worker_keys: Callable[[list[str]], None] | None = None
) -> UpdateReport:
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if keys is not None:
        make_client(sock, keys.own, keys.broker)
    try:
        sock.connect(broker)
        deadline = time.monotonic() + timeout_s
        if not sock.poll(int(timeout_s * 1000), zmq.POLLOUT):
            raise RemoteTargetTimeout(f"no broker at {broker} took the update within {timeout_s:g} s: is it running there?")
        sock.send_multipart(pack(request))
        while (remaining := deadline - time.monotonic()) > 0:
            if not sock.poll(int(remaining * 1000)):
                break
            message, _ = unpack(sock.recv_multipart(), FRONTEND_OUTBOUND)
            if isinstance(message, UpdateReport) and message.request_id == request.request_id:
                return message
            if isinstance(message, WorkerKeys) and on_worker_keys is not None:  # the workers told to pull, admitted
                on_worker_keys(message.keys)
            if isinstance(message, ErrorReply):
                raise RemoteTargetError(f"the broker at {broker} refused the update: {message.message}")
        raise RemoteTargetTimeout(f"no update report from the broker at {broker} within {timeout_s:g} s (--timeout)")
    finally:
        sock.close(linger=0)
        context.term()


def publish_weights(
    broker: str,
    service: str,
    tensors: Mapping[str, torch.Tensor],
    target_version: int,
    *,
    timeout_s: float = 600.0,
    chunk_bytes: int = DEFAULT_TRANSFER_CHUNK_BYTES,
    endpoint: str | None = None,
    keys: PeerKeys | None = None,
    at_once: int | None = None,
    nixl: bool | None = None,
    pair: bool | None = None,
) -> UpdateReport:
    """Every worker of ``service`` takes ``tensors`` (any subset of the target's, by their state-dict names, straight
    from this process's memory) and serves them as ``target_version``, as RL frameworks push weights to their rollout
    engines. The workers pull them from a socket this call opens (``endpoint``: default, this host's address towards
    the broker, on a free port), in pieces of ``chunk_bytes``, each at its own pace; nothing is copied whole, and a
    device tensor is copied to the host a piece at a time. ``at_once`` of the workers load at a time, the others serving
    meanwhile (None: all together). ``nixl``: also offer the tensors to NIXL, so that a worker that has it reads them
    one-sided (RDMA, GPU memory directly) instead of pulling frames; None: when NIXL is installed here and ``keys`` is
    not given. ``keys`` (a secure deployment: this process's pair, on the broker's rank allow-list, and the broker's
    public key): the socket is encrypted, and admits only the workers the broker tells to pull; NIXL's reads are not
    encrypted, so they are offered then only with ``nixl=True``. ``pair``: also offer a worker process on this machine a
    pair group of its own (NCCL between the trainer's GPU and the worker's, or gloo); None: NCCL where the tensors are
    on a GPU, no gloo (on one machine NIXL or frames move host memory as fast); True: gloo for host tensors too.
    Returns when every worker told has answered or left."""
    from draftfeed.dataplane.nixl.transport import unavailable
    from draftfeed.dataplane.weights.pair_pieces import pair_backend
    from draftfeed.dataplane.weights.publisher import WeightsPublisher

    if nixl and (why := unavailable()) is not None:
        raise UsageError(f"publish_weights(nixl=True): {why}")
    offer = unavailable() is None and keys is None if nixl is None else nixl  # NIXL's reads are not encrypted
    where = endpoint or f"tcp://{local_address_towards(broker)}:*"
    backend = pair_backend(list(tensors.values()), pair)
    publisher = WeightsPublisher(tensors, endpoint=where, chunk_bytes=chunk_bytes, nixl=offer, keys=None if keys is None else keys.own, pair=backend)
    publisher.start()
    try:
        source_key = None if keys is None else keys.own.public.decode()
        request = _request(service=service, source=publisher.endpoint, source_key=source_key, target_version=target_version, at_once=at_once)
        return _update(broker, request, timeout_s, keys, on_worker_keys=publisher.admit)
    finally:
        publisher.stop()


def format_report(report: UpdateReport) -> str:
    """One line a worker: its name, whether it took the update, the version it serves, and why not."""
    lines = []
    for result in report.workers:
        said = "updated" if result.ok else "kept"
        lines.append(f"{result.worker}: {said}, serves version {result.target_version}" + (f" ({result.message})" if result.message else ""))
    return "\n".join(lines) if lines else "no worker answered"
