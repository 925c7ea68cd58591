"""Tensors from one worker to one rank over a dedicated two-rank torch.distributed group.

The group is the pair's own: its rendezvous is a ``TCPStore`` the worker (rank 0, the sender) hosts on a
free port, and it is built with the backend's process-group class directly, so it never touches the
training job's default process group and needs nothing but torch on the rank's side. The tensors' names,
dtypes and shapes travel ahead on ZeroMQ (``TensorSpec``, as for frames), so the receiver allocates before
it receives. Every tensor is sent as its raw bytes (a flat uint8 view) and viewed back as its dtype, so
dtypes a backend does not carry (bool, bfloat16 on some) arrive bit for bit.

A send or receive that fails or passes its timeout leaves the group out of step: the caller must
``close()`` it (which aborts the group) and never send on it again; a new group, with a new generation,
is built for the next attempt. The worker's side of the protocol is dataplane/pair_group/worker.py, the rank's
dataplane/pair_group/rank.py; this module is the transport alone.

Tensors go in the pieces dataplane/frames/chunks.py plans for frames (the worker's --transfer-chunk-bytes, named in
the header), a few at a time, each wait bounded: a long transfer that keeps moving never times out. gloo carries CPU
tensors: on gloo the sender copies each piece of a CUDA tensor to the host as it goes, and a CUDA receiver takes each
piece through a host buffer of its own into the tensor it allocated on its device. On NCCL both sides use CUDA
tensors and a wait ends when the device has finished.
"""

from __future__ import annotations

import socket
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from draftfeed.dataplane.frames.chunks import Piece, chunk_plan
from draftfeed.dataplane.frames.codec import allocate, dtype_name, flat_bytes
from draftfeed.schemas.messages import TensorSpec
from draftfeed.schemas.protocol import DEFAULT_TRANSFER_CHUNK_BYTES

BACKENDS = ("gloo", "nccl")
WINDOW = 4  # pieces in flight at once: overlap without holding more than a few pieces' staging memory
SENDER, RECEIVER = 0, 1


class DataPlaneError(RuntimeError):
    """The pair's group failed (a peer died, a timeout, a backend error); it must be closed, not reused."""


def host_store(host: str = "127.0.0.1", timeout_s: float = 30.0) -> dist.TCPStore:
    """The sender's rendezvous store on a free port (``store.port``) of the interface ``host`` only, returned
    without waiting for the receiver. The store has no authentication: keep it open only until the group is
    built (drop the last reference and it stops listening)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.bind((host, 0))
        listener.listen(8)
        port = listener.getsockname()[1]
    except OSError:
        listener.close()
        raise
    return dist.TCPStore(
        host,
        port,
        world_size=2,
        is_master=True,
        timeout=timedelta(seconds=timeout_s),
        wait_for_workers=False,
        master_listen_fd=listener.detach(),  # the store owns the socket from here
    )


def join_store(host: str, port: int, timeout_s: float = 30.0) -> dist.TCPStore:
    """The receiver's client of the sender's store."""
    return dist.TCPStore(host, port, world_size=2, is_master=False, timeout=timedelta(seconds=timeout_s), wait_for_workers=False)


def describe(tensors: Mapping[str, torch.Tensor]) -> list[TensorSpec]:
    """What the receiver needs to allocate, in sending order."""
    return [TensorSpec(name=name, dtype=dtype_name(tensor.dtype), shape=list(tensor.shape)) for name, tensor in tensors.items()]


class PairGroup:
    """One worker-rank pair's two-rank group: rank 0 sends, rank 1 receives."""

    def __init__(self, store: dist.Store, rank: int, backend: str, generation: int = 0, timeout_s: float = 30.0, namespace: str = "") -> None:
        """``namespace``: a secret both sides know (sent on the encrypted data socket) under which the group's
        keys live in the store, so that a stranger who reaches the store cannot guess or overwrite them."""
        if backend not in BACKENDS:
            raise ValueError(f"data plane backend {backend!r} is not one of {', '.join(BACKENDS)}")
        if rank not in (SENDER, RECEIVER):
            raise ValueError(f"a pair group has ranks 0 (the worker) and 1 (the training rank), not {rank}")
        self.rank = rank
        self.backend = backend
        self.timeout = timedelta(seconds=timeout_s)
        prefixed = dist.PrefixStore(f"draftfeed-pair/{namespace}/{generation}", store)
        try:
            if backend == "gloo":
                self._group = dist.ProcessGroupGloo(prefixed, rank, 2, self.timeout)
            else:
                options = dist.ProcessGroupNCCL.Options()
                options._timeout = self.timeout
                self._group = dist.ProcessGroupNCCL(prefixed, rank, 2, options)
        except RuntimeError as exc:
            raise DataPlaneError(f"the {backend} group of this pair could not be built: {exc}") from exc
        self.closed = False

    def send(self, tensors: Mapping[str, torch.Tensor], chunk_bytes: int = DEFAULT_TRANSFER_CHUNK_BYTES) -> None:
        """Send every tensor's bytes to the receiver in the pieces dataplane/frames/chunks.py plans (tag = the piece's
        index), at most ``WINDOW`` in flight; returns when the backend is done with them. On gloo a CUDA tensor's
        piece is copied to the host as it is sent, never the whole tensor."""
        self._check_open()
        flats = [flat_bytes(tensor) for tensor in tensors.values()]
        staged = self.backend == "gloo"

        def piece(tensor: int, offset: int, nbytes: int) -> torch.Tensor:
            flat = flats[tensor][offset : offset + nbytes]
            return flat.cpu() if staged else flat

        specs = describe(tensors)
        self._transfer(self._group.send, RECEIVER, chunk_plan(specs, chunk_bytes), piece, None, what=f"sending {', '.join(tensors)}")

    def warm_up(self) -> None:
        """One byte across, right after both sides built the group: NCCL sets its communicator up here (it does so
        at the first transfer), so that the store is no longer needed afterwards, and a broken group shows now."""
        if self.rank == SENDER:
            self.send({"warm_up": torch.zeros(1, dtype=torch.uint8)})
        else:
            self.receive([TensorSpec(name="warm_up", dtype="uint8", shape=[1])])

    def receive(
        self, specs: Sequence[TensorSpec], device: torch.device | str = "cpu", chunk_bytes: int = DEFAULT_TRANSFER_CHUNK_BYTES
    ) -> dict[str, torch.Tensor]:
        """Receive the tensors ``specs`` describe (from the sender's ``describe``), allocated on ``device``, piece by
        piece as the sender sends them. On gloo a CUDA ``device`` takes each piece through host memory of its own."""
        self._check_open()
        device = torch.device(device)
        bounced = self.backend == "gloo" and device.type != "cpu"
        flats, tensors = allocate(specs, device)

        def piece(tensor: int, offset: int, nbytes: int) -> torch.Tensor:
            return torch.empty(nbytes, dtype=torch.uint8) if bounced else flats[tensor][offset : offset + nbytes]

        def landed(tensor: int, offset: int, buffer: torch.Tensor) -> None:
            flats[tensor][offset : offset + buffer.numel()].copy_(buffer)

        what = f"receiving {', '.join(s.name for s in specs)}"
        self._transfer(self._group.recv, SENDER, chunk_plan(specs, chunk_bytes), piece, landed if bounced else None, what=what)
        return tensors

    def post(self, buffer: torch.Tensor, tag: int) -> dist.Work:
        """Start sending (rank 0) or receiving (rank 1) one flat uint8 ``buffer`` on ``tag``; ``wait`` for it. For a
        caller that moves its own pieces (dataplane/weights/), each into a buffer it reuses."""
        self._check_open()
        try:
            if self.rank == SENDER:
                return self._group.send([buffer], RECEIVER, tag)
            return self._group.recv([buffer], SENDER, tag)
        except RuntimeError as exc:
            self.close()
            raise DataPlaneError(f"{self.backend} pair group failed posting piece {tag}: {exc}") from exc

    def wait(self, work: dist.Work, buffer: torch.Tensor) -> None:
        """Until ``post``'s ``work`` on ``buffer`` is done, within the timeout; a failure closes the group."""
        try:
            self._finish((work, None, buffer), None)  # type: ignore[arg-type]
        except RuntimeError as exc:
            self.close()
            raise DataPlaneError(f"{self.backend} pair group failed: {exc}") from exc

    def close(self) -> None:
        """Abort the group (a group that failed may be mid-transfer); safe to call twice."""
        if self.closed:
            return
        self.closed = True
        try:
            self._group.abort()
        except RuntimeError:
            pass

    def _transfer(
        self,
        start: Callable[..., dist.Work],
        peer: int,
        pieces: Sequence[Piece],
        buffer_of: Callable[[int, int, int], torch.Tensor],
        landed: Callable[[int, int, torch.Tensor], None] | None,
        what: str,
    ) -> None:
        """Send or receive ``pieces`` (each on its own tag, ``WINDOW`` overlapping), each wait bounded by the timeout:
        a transfer fails only when a piece stops moving. A failure closes the group and raises DataPlaneError."""
        in_flight: deque[tuple[dist.Work, Piece, torch.Tensor]] = deque()
        try:
            for tag, piece in enumerate(pieces):
                buffer = buffer_of(*piece)
                in_flight.append((start([buffer], peer, tag), piece, buffer))
                if len(in_flight) >= WINDOW:
                    self._finish(in_flight.popleft(), landed)
            while in_flight:
                self._finish(in_flight.popleft(), landed)
        except RuntimeError as exc:
            self.close()
            raise DataPlaneError(f"{self.backend} pair group failed {what}: {exc}") from exc

    def _finish(self, started: tuple[dist.Work, Piece, torch.Tensor], landed: Callable[[int, int, torch.Tensor], None] | None) -> None:
        work, piece, buffer = started
        if self.backend == "gloo":
            work.wait(self.timeout)  # blocks the CPU until done; a dead peer ends it at once
        else:
            self._wait_for_device(work)
        if landed is not None:
            landed(piece.tensor, piece.offset, buffer)

    def _wait_for_device(self, work: dist.Work) -> None:
        """NCCL work finishes on the device: poll it (its completion is a CUDA event) until the timeout,
        so that the caller's tensors are done with when this returns and a hung peer cannot block forever."""
        deadline = time.monotonic() + self.timeout.total_seconds()
        pause = 1e-5
        while not work.is_completed():
            if time.monotonic() > deadline:
                raise RuntimeError(f"timed out after {self.timeout.total_seconds():.0f} s")
            time.sleep(pause)  # polling a device event, not synchronising peers
            pause = min(pause * 2, 1e-3)
        work.wait()  # raises the backend's error if the work failed

    def _check_open(self) -> None:
        if self.closed:
            raise DataPlaneError("this pair group was closed after a failure; build a new one")
