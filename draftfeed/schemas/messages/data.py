"""The messages on a rank's data socket: a worker's result or failure, and the handshakes of the pair-group and nixl
planes (the rank's answers to them come back on the worker's connection).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from draftfeed.schemas.messages.common import Generation, Name, PairBackend, RequestId, Seconds, Strict, SubmitKind, TargetVersion, TensorSpec, Token
from draftfeed.schemas.protocol import MAX_TRANSFER_CHUNK_BYTES


class Result(Strict):
    """Supervision. On plane ``frames`` the tensors follow as frames, or, with ``chunk_bytes``, in ``chunk`` messages
    of at most that many bytes each, in the order dataplane/frames/chunks.py plans them; on ``pair`` this header carries no
    frames and the tensors follow on the pair group of ``generation``, in the order of ``tensors``; on
    ``nixl`` the tensors were written into the rank's receive slot ``slot`` (granted to ``generation``), laid
    out as dataplane/nixl/layout.py packed_layout says."""

    type: Literal["result"] = "result"
    request_id: RequestId
    token: Token = 0
    kind: SubmitKind
    worker: Name
    tensors: list[TensorSpec] = Field(max_length=16)
    plane: Literal["frames", "pair", "nixl"] = "frames"
    generation: Generation | None = None
    slot: Annotated[int, Field(ge=0, lt=2**31)] | None = None
    chunk_bytes: Annotated[int, Field(gt=0, le=MAX_TRANSFER_CHUNK_BYTES)] | None = None
    # With the worker's --checksum: each tensor's XXH3-64 (16 hex digits), in the order of ``tensors``.
    digests: list[Annotated[str, Field(pattern=r"^[0-9a-f]{16}$")]] | None = Field(default=None, max_length=16)
    target_version: TargetVersion = 0  # the version of the target's weights that computed it


class Chunk(Strict):
    """Piece ``index`` of a chunked result's tensor bytes (``Result.chunk_bytes``): one frame follows, written by the rank
    at the place dataplane/frames/chunks.py gives that index."""

    type: Literal["chunk"] = "chunk"
    request_id: RequestId
    token: Token = 0
    worker: Name
    index: Annotated[int, Field(ge=0, lt=2**40)]


class PairOpen(Strict):
    """The worker opens a pair group with this rank: join the store at store_host:store_port as rank 1."""

    type: Literal["pair_open"] = "pair_open"
    worker: Name
    generation: Generation
    backend: PairBackend
    store_host: Name
    store_port: Annotated[int, Field(gt=0, lt=65536)]
    nonce: Annotated[str, Field(min_length=32, max_length=64)]  # the group's namespace in the store
    timeout_s: Seconds
    reason: Annotated[str, Field(max_length=512)]


class PairClose(Strict):
    """Either side of a pair: the group of this generation is torn down; send nothing more on it."""

    type: Literal["pair_close"] = "pair_close"
    worker: Name
    generation: Generation
    reason: Annotated[str, Field(max_length=512)]


class NixlOpen(Strict):
    """The worker opens a nixl pair with this rank: answer with this rank's agent metadata (``nixl_ready``)."""

    type: Literal["nixl_open"] = "nixl_open"
    worker: Name
    generation: Generation
    agent: Name  # the worker's NIXL agent: notifications from it complete this pair's writes
    timeout_s: Seconds  # the worker gives up on a write after this long
    reason: Annotated[str, Field(max_length=512)]


class NixlReady(Strict):
    """The rank's side of a nixl pair is up: one frame follows, the rank's NIXL agent metadata."""

    type: Literal["nixl_ready"] = "nixl_ready"
    worker: Name
    generation: Generation
    agent: Name
    memory: Literal["DRAM", "VRAM"]


class NixlWant(Strict):
    """The worker has an answer of ``nbytes`` for this rank: grant it a receive slot."""

    type: Literal["nixl_want"] = "nixl_want"
    worker: Name
    generation: Generation
    want: Annotated[int, Field(ge=0, lt=2**62)]
    nbytes: Annotated[int, Field(ge=0, lt=2**40)]


class NixlGrant(Strict):
    """A receive slot for one want (or, with ``refused``, why there is none: that answer goes as frames). A slot
    registered since the worker last loaded the rank's metadata comes with one frame: that slot's metadata."""

    type: Literal["nixl_grant"] = "nixl_grant"
    generation: Generation
    want: Annotated[int, Field(ge=0, lt=2**62)]
    slot: Annotated[int, Field(ge=0, lt=2**31)] = 0
    address: Annotated[int, Field(ge=0, lt=2**64)] = 0
    nbytes: Annotated[int, Field(ge=0, lt=2**40)] = 0
    device: Annotated[int, Field(ge=0, lt=1024)] = 0
    refused: Annotated[str, Field(max_length=512)] | None = None


class NonFiniteAt(Strict):
    """Where a batch's supervision first held NaN or Inf (contract/finite.py): its tensor, its index there (row and
    position first), the value, and the layer id whose slice holds it where the tensor concatenates layers."""

    tensor: Name
    index: list[Annotated[int, Field(ge=0)]] = Field(max_length=8)
    value: Literal["nan", "inf", "-inf"]
    layer: int | None = None


class Failure(Strict):
    """A request the worker could not serve, with the reason for the user; ``nonfinite`` where the reason is that its
    supervision held NaN or Inf (the rank raises NonFiniteSupervision)."""

    type: Literal["failure"] = "failure"
    request_id: RequestId
    token: Token = 0
    worker: Name
    message: str
    nonfinite: NonFiniteAt | None = None
