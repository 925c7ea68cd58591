"""The messages of a weight update streamed from a trainer's memory (``publish_weights``; docs/versions.md): each worker
told to update connects to the publisher's socket and pulls the manifest, page by page, then the pieces, one at a
time (dataplane/weights/)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from draftfeed.schemas.messages.common import Strict, TensorSpec

MANIFEST_PAGE = 2048  # tensor specs in one manifest page: a 1 TB target's ~100k tensors come in ~50 pages


class WeightsPull(Strict):
    """worker -> publisher: a page of the manifest (``what`` manifest, ``index`` the page) or a piece of the bytes
    (``what`` piece, ``index`` the piece, in the plan both compute: dataplane/weights/plan.py); ``nixl``: the
    publisher's NIXL agent metadata, to read the pieces itself; ``pair``: a pair group of its own with the publisher,
    over which the publisher sends every piece in order; ``done``: it has what it wanted, or gives up."""

    type: Literal["weights_pull"] = "weights_pull"
    update: Annotated[int, Field(ge=0)]
    what: Literal["manifest", "piece", "nixl", "pair", "done"]
    index: Annotated[int, Field(ge=0)] = 0


class WeightsRegion(Strict):
    """Where a tensor's bytes lie in the publisher's memory, registered with its NIXL agent (a worker reads them)."""

    address: Annotated[int, Field(ge=0, lt=2**64)]
    device: Annotated[int, Field(ge=0, lt=1024)] = 0
    kind: Literal["DRAM", "VRAM"] = "DRAM"


class WeightsManifest(Strict):
    """publisher -> worker: tensors ``first`` to ``first + len(tensors)`` of ``total``, and the piece size."""

    type: Literal["weights_manifest"] = "weights_manifest"
    update: Annotated[int, Field(ge=0)]
    first: Annotated[int, Field(ge=0)]
    total: Annotated[int, Field(ge=1)]
    chunk_bytes: Annotated[int, Field(ge=1 << 10, le=1 << 30)]
    tensors: list[TensorSpec] = Field(max_length=MANIFEST_PAGE)
    # The publisher offers NIXL: where each of ``tensors`` lies (the same order), and its agent's name (docs/versions.md).
    nixl_agent: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    regions: list[WeightsRegion] | None = Field(default=None, max_length=MANIFEST_PAGE)
    # The publisher offers a pair group (gloo, or nccl for its CUDA tensors) to a worker on its machine (``host_id``:
    # the boot id, as the data planes compare them).
    pair_backend: Literal["gloo", "nccl"] | None = None
    host_id: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    pair_gpu: Annotated[str, Field(min_length=1, max_length=64)] | None = None  # nccl: the tensors' GPU (NCCL needs two)


class WeightsNixl(Strict):
    """publisher -> worker: its NIXL agent's metadata follows in one frame."""

    type: Literal["weights_nixl"] = "weights_nixl"
    update: Annotated[int, Field(ge=0)]
    agent: Annotated[str, Field(min_length=1, max_length=256)]


class WeightsPair(Strict):
    """publisher -> worker: join the pair group at the store ``host``:``port`` as rank 1, under ``namespace`` (a secret
    of this pull's), and receive every piece of the plan in order, piece ``i`` on tag ``i``."""

    type: Literal["weights_pair"] = "weights_pair"
    update: Annotated[int, Field(ge=0)]
    host: Annotated[str, Field(min_length=1, max_length=256)]
    port: Annotated[int, Field(ge=1, le=65535)]
    backend: Literal["gloo", "nccl"]
    namespace: Annotated[str, Field(min_length=16, max_length=64)]


class WeightsPiece(Strict):
    """publisher -> worker: piece ``index`` of the plan; its bytes follow in one frame."""

    type: Literal["weights_piece"] = "weights_piece"
    update: Annotated[int, Field(ge=0)]
    index: Annotated[int, Field(ge=0)]
