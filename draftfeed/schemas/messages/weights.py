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
    (``what`` piece, ``index`` the piece, in the plan both compute: dataplane/weights/plan.py); ``done``: it has what it
    wanted, or gives up."""

    type: Literal["weights_pull"] = "weights_pull"
    update: Annotated[int, Field(ge=0)]
    what: Literal["manifest", "piece", "done"]
    index: Annotated[int, Field(ge=0)] = 0


class WeightsManifest(Strict):
    """publisher -> worker: tensors ``first`` to ``first + len(tensors)`` of ``total``, and the piece size."""

    type: Literal["weights_manifest"] = "weights_manifest"
    update: Annotated[int, Field(ge=0)]
    first: Annotated[int, Field(ge=0)]
    total: Annotated[int, Field(ge=1)]
    chunk_bytes: Annotated[int, Field(ge=1 << 10, le=1 << 30)]
    tensors: list[TensorSpec] = Field(max_length=MANIFEST_PAGE)


class WeightsPiece(Strict):
    """publisher -> worker: piece ``index`` of the plan; its bytes follow in one frame."""

    type: Literal["weights_piece"] = "weights_piece"
    update: Annotated[int, Field(ge=0)]
    index: Annotated[int, Field(ge=0)]
