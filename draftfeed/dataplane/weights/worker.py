"""The worker's half: pull a weight update from its publisher and write it into the target's tensors in place.

The manifest comes first, page by page, and every tensor it names is checked against the target's (name, shape,
dtype, contiguous) before any byte is written: a mismatch leaves the target as it was (``UpdateRefused``). Then the
pieces come one at a time, each checked finite (a piece holds whole elements: its size is a multiple of 8 bytes) and
written into its place, the next few asked for meanwhile: memory beyond the target's own is those few pieces. A tensor
sharded over a tensor-parallel group (a DTensor) is staged whole on the host while its pieces come, and keeps its own
shard once its last piece is in (place.py): every process of the group pulls the whole update itself, and holds at
most one whole tensor more. The pieces come as frames on the publisher's socket; over a pair group of their own where
the publisher offers one on this machine (pair_pieces.py); or read one-sided from the publisher's memory where it
offers NIXL and this process has it (nixl_reads.py). A fault after the first write (the publisher gone, a NaN in a
later piece) leaves a mixture of versions (``UpdateBroken``): the worker must not serve it, and leaves."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping

import torch
import zmq

from draftfeed.dataplane.choice import gpu_uuid, host_id
from draftfeed.dataplane.frames.codec import DTYPES
from draftfeed.dataplane.weights.nixl_reads import NixlReads
from draftfeed.dataplane.weights.pair_pieces import PairReceives
from draftfeed.dataplane.weights.place import is_sharded, local, place
from draftfeed.dataplane.weights.plan import Piece, plan
from draftfeed.schemas.frames import frame_bytes, pack, unpack
from draftfeed.schemas.messages import (
    MANIFEST_PAGE,
    WEIGHTS_OUTBOUND,
    ErrorReply,
    TensorSpec,
    WeightsManifest,
    WeightsNixl,
    WeightsPair,
    WeightsPiece,
    WeightsPull,
    WeightsRegion,
)
from draftfeed.schemas.tensor_specs import frame_buffer
from draftfeed.security.curve import make_client
from draftfeed.security.keys import KeyPair

log = logging.getLogger("draftfeed.weights")
AHEAD = 4  # pieces asked for before the one being written: at most this many wait in the socket (64 MiB at 16 MiB)


class UpdateRefused(ValueError):
    """Nothing was written: the worker keeps its version."""


class UpdateBroken(RuntimeError):
    """Some tensors were written, not all: the worker holds a mixture and must leave."""


def tensor_problem(current: Mapping[str, torch.Tensor], name: str, shape: list[int], dtype: torch.dtype | None) -> str | None:
    """Why a tensor of ``name``, ``shape`` and ``dtype`` cannot replace the target's of that name (one line that names
    it), or None: the checks of every update, from a file or pulled."""
    held = current.get(name)
    if held is None:
        near = sorted(n for n in current if n.rsplit(".", 1)[-1] == name.rsplit(".", 1)[-1])[:2]
        hint = f" (the target has e.g. {', '.join(near)})" if near else ""
        return f"tensor {name}: the target has no tensor of that name{hint}"
    if list(shape) != list(held.shape):
        return f"tensor {name}: shape {list(shape)}, the target's is {list(held.shape)}"
    if dtype != held.dtype:
        return f"tensor {name}: dtype {dtype}, the target's is {held.dtype} (convert it before the update)"
    return None


def spec_problem(current: Mapping[str, torch.Tensor], specs: list[TensorSpec]) -> str | None:
    """Why the announced tensors cannot replace the target's, naming the first, or None."""
    for spec in specs:
        if (problem := tensor_problem(current, spec.name, spec.shape, DTYPES.get(spec.dtype))) is not None:
            return problem
        if not local(current[spec.name]).is_contiguous():
            return f"tensor {spec.name}: the target's is not contiguous and cannot be written in place"
    return None


class _Puller:
    def __init__(self, source: str, update: int, timeout_s: float, keys: tuple[KeyPair, str] | None) -> None:
        self.source, self.update, self.timeout_s = source, update, timeout_s
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        if keys is not None:  # encrypted: this worker's pair, and only the publisher holding that key's secret
            make_client(self.socket, keys[0], keys[1].encode())
        self.socket.connect(source)

    def ask(self, what: str, index: int = 0) -> tuple[object, list]:
        self.send(what, index)
        return self.receive()

    def send(self, what: str, index: int = 0) -> None:
        self.socket.send_multipart(pack(WeightsPull(update=self.update, what=what, index=index)))

    def receive(self) -> tuple[object, list]:
        """The next answer (the publisher answers one worker's pulls in the order they came)."""
        deadline = time.monotonic() + self.timeout_s
        while (remaining := deadline - time.monotonic()) > 0:
            if self.socket.poll(int(remaining * 1000)):
                message, frames = unpack(self.socket.recv_multipart(copy=False), WEIGHTS_OUTBOUND)
                if isinstance(message, ErrorReply):
                    raise ConnectionError(message.message)
                if getattr(message, "update", None) == self.update:
                    return message, frames
        raise TimeoutError(f"the weights publisher at {self.source} did not answer within {self.timeout_s:g} s")

    def close(self) -> None:
        try:
            self.socket.send_multipart(pack(WeightsPull(update=self.update, what="done")), flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            pass
        self.socket.close(linger=0)
        self.context.term()


def pull_keys(source_key: str | None, keys: KeyPair | None) -> tuple[KeyPair, str] | None:
    """The keys a pull from a publisher with ``source_key`` uses (this worker's ``keys``), None for a plaintext one;
    UpdateRefused when the publisher is encrypted and this worker has no keys."""
    if source_key is None:
        return None
    if keys is None:
        raise UpdateRefused("the publisher's socket is encrypted and this worker has no keys: start it with --keys (the deployment's key folder)")
    return keys, source_key


def pull_update(
    source: str,
    update: int,
    current: Mapping[str, torch.Tensor],
    check_finite: bool,
    timeout_s: float = 60.0,
    keys: tuple[KeyPair, str] | None = None,
    into: Callable[[list[TensorSpec]], list[torch.Tensor]] | None = None,
) -> int:
    """Pull update ``update`` from ``source`` into ``current`` (the target's tensors by name, in place); the bytes
    written. UpdateRefused before any write, UpdateBroken after. ``keys``: this worker's pair and the publisher's public
    key, for an encrypted publisher. ``into``: where the announced tensors go instead, once checked against
    ``current`` (an engine that loads them itself afterwards: it may refuse them, UpdateRefused, before any byte)."""
    puller = _Puller(source, update, timeout_s, keys)
    try:
        try:
            manifest, _ = puller.ask("manifest", 0)
            assert isinstance(manifest, WeightsManifest)
            specs, regions, chunk_bytes = list(manifest.tensors), list(manifest.regions or []), manifest.chunk_bytes
            while len(specs) < manifest.total:
                page, _ = puller.ask("manifest", len(specs) // MANIFEST_PAGE)
                assert isinstance(page, WeightsManifest)
                specs.extend(page.tensors)
                regions.extend(page.regions or [])
        except (ConnectionError, TimeoutError) as exc:
            raise UpdateRefused(str(exc)) from None
        problem = spec_problem(current, specs) if chunk_bytes % 8 == 0 else f"pieces of {chunk_bytes} bytes, not a multiple of 8"
        if problem is not None:
            raise UpdateRefused(problem)
        pieces = plan(specs, chunk_bytes)
        held = into(specs) if into is not None else [current[spec.name] for spec in specs]
        writer = _Writer(held, pieces)
        device = local(held[0]).device if held else torch.device("cpu")
        reads = _pieces_from(puller, manifest, regions if len(regions) == len(specs) else [], pieces, chunk_bytes, timeout_s, device)
        try:
            try:
                _write_all(reads, specs, pieces, writer, check_finite)
            except UpdateRefused as exc:
                if not reads.failed:
                    raise
                log.warning(
                    "draftfeed: weights from %s: %s failed before any byte was written (%s): pulled as frames", puller.source, reads.plane, exc
                )
                reads.close()
                reads = _FramePieces(puller)
                _write_all(reads, specs, pieces, writer, check_finite)
        finally:
            reads.close()
        return writer.written
    finally:
        puller.close()


def _write_all(
    reads: _FramePieces | NixlReads | PairReceives, specs: list[TensorSpec], pieces: list[Piece], writer: _Writer, check_finite: bool
) -> None:
    """Every piece from ``reads``, checked and written in order, ``AHEAD`` asked for before the one being written."""
    for index, piece in enumerate(pieces):
        try:
            if index == 0:
                for ahead in range(min(AHEAD, len(pieces))):  # a few asked for ahead: the wire never waits on the writes
                    reads.ask(ahead)
            data = reads.take(index)
        except (ConnectionError, TimeoutError) as exc:
            raise _broken_or_refused(writer.written, str(exc)) from None
        spec = specs[piece.tensor]
        if data.numel() != piece.nbytes:
            raise _broken_or_refused(writer.written, f"tensor {spec.name}: a piece of {data.numel()} bytes where {piece.nbytes} were due")
        if check_finite and (why := _not_finite(spec, data)) is not None:
            raise _broken_or_refused(writer.written, why)
        writer.write(index, data)
        if index + AHEAD < len(pieces):
            try:
                reads.ask(index + AHEAD)  # after the write: a NIXL slot is free again
            except (ConnectionError, TimeoutError) as exc:
                raise _broken_or_refused(writer.written, str(exc)) from None


class _FramePieces:
    """Pieces pulled as frames from the publisher's socket, answered in the order asked."""

    plane = "frames"
    failed = False  # a fault here is the publisher's: nothing to fall back to

    def __init__(self, puller: _Puller) -> None:
        self.puller = puller

    def ask(self, index: int) -> None:
        self.puller.send("piece", index)

    def take(self, index: int) -> torch.Tensor:
        reply, frames = self.puller.receive()
        if not isinstance(reply, WeightsPiece) or reply.index != index:
            raise ConnectionError(f"piece {index} was due, the publisher sent {reply}")
        if len(frames) != 1:
            raise ConnectionError(f"piece {index}: {len(frames)} frames where one was due")
        return torch.frombuffer(frame_buffer(frames[0]), dtype=torch.uint8)

    def close(self) -> None:
        pass


def _pieces_from(
    puller: _Puller,
    manifest: WeightsManifest,
    regions: list[WeightsRegion],
    pieces: list[Piece],
    chunk_bytes: int,
    timeout_s: float,
    device: torch.device,
) -> _FramePieces | NixlReads | PairReceives:
    """A pair group where the publisher offers one on this machine (NCCL only onto a GPU); else NIXL reads where it
    offers them and this process has NIXL; else frames, also when the chosen plane cannot start (said, and nothing is
    written before it is chosen)."""
    from draftfeed.dataplane.nixl.transport import NixlError, unavailable

    if not pieces:
        return _FramePieces(puller)
    backend = manifest.pair_backend
    one_gpu = backend == "nccl" and manifest.pair_gpu is not None and manifest.pair_gpu == gpu_uuid(device)  # NCCL refuses it
    if backend is not None and manifest.host_id == host_id() and (backend == "gloo" or (device.type == "cuda" and not one_gpu)):
        try:
            offer, _ = puller.ask("pair")
            if not isinstance(offer, WeightsPair):
                raise ConnectionError(f"the publisher answered {offer} to a pair pull")
            receives = PairReceives(offer, pieces, chunk_bytes, AHEAD, device, timeout_s)
        except (ConnectionError, TimeoutError, RuntimeError) as exc:
            log.warning("draftfeed: weights from %s: no %s pair group (%s): trying the next plane", puller.source, backend, exc)
        else:
            log.info("draftfeed: weights from %s: received over a %s pair group", puller.source, backend)
            return receives
    if manifest.nixl_agent is None or not regions or unavailable() is not None:
        return _FramePieces(puller)
    try:
        offer, frames = puller.ask("nixl")
        if not isinstance(offer, WeightsNixl) or len(frames) != 1:
            raise NixlError(f"the publisher answered {offer} to a NIXL metadata pull")
        reads = NixlReads(frame_bytes(frames[0]), regions, pieces, chunk_bytes, AHEAD, timeout_s)
    except (NixlError, ConnectionError, TimeoutError) as exc:
        log.warning("draftfeed: weights from %s: NIXL cannot read them (%s): pulled as frames", puller.source, exc)
        return _FramePieces(puller)
    log.info("draftfeed: weights from %s: read over NIXL from agent %s", puller.source, manifest.nixl_agent)
    return reads


class _Writer:
    """Where each piece goes: straight into its tensor's bytes, or, for a DTensor, into a host copy of the whole tensor,
    placed (the process's own shard kept) once the last piece of that tensor is in. ``written``: the update's bytes in
    their place so far (a DTensor's count once it is placed)."""

    def __init__(self, held: list[torch.Tensor], pieces: list[Piece]) -> None:
        self.held, self.pieces = held, pieces
        self.flat = [None if is_sharded(tensor) else tensor.view(-1).view(torch.uint8) for tensor in held]
        self.staged: torch.Tensor | None = None
        self.written = 0

    def write(self, index: int, data: torch.Tensor) -> None:
        piece = self.pieces[index]
        flat = self.flat[piece.tensor]
        if flat is not None:
            flat[piece.offset : piece.offset + piece.nbytes].copy_(data)
            self.written += piece.nbytes
            return
        held = self.held[piece.tensor]
        if piece.offset == 0:
            self.staged = torch.empty(held.numel() * held.element_size(), dtype=torch.uint8)
        assert self.staged is not None
        self.staged[piece.offset : piece.offset + piece.nbytes].copy_(data)
        if piece.offset + piece.nbytes == self.staged.numel():
            place(held, self.staged.view(held.dtype).view(held.shape))
            self.written += self.staged.numel()
            self.staged = None


def _broken_or_refused(written: int, why: str) -> Exception:
    if written == 0:
        return UpdateRefused(why)
    return UpdateBroken(f"{why}; {written} bytes of the update were already written: the worker holds a mixture of versions")


def _not_finite(spec: TensorSpec, data: torch.Tensor) -> str | None:
    """Why a piece of a floating tensor is not finite, or None: one reduction, no mask (a NaN reaches both ends of
    ``aminmax``, an Inf is one of them)."""
    dtype = DTYPES[spec.dtype]
    if not dtype.is_floating_point or not data.numel():
        return None
    low, high = torch.aminmax(data.view(dtype))
    if not (bool(torch.isfinite(low)) and bool(torch.isfinite(high))):
        return f"tensor {spec.name}: holds NaN or Inf (the worker's finite check is on)"
    return None
