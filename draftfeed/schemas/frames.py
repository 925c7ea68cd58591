"""Message <-> frames: ``[SIGNATURE, header JSON, *tensor frames]``, checked on the way in (no torch here)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, ValidationError

from draftfeed.schemas.errors import MalformedMessage, ProtocolVersionMismatch
from draftfeed.schemas.messages import Accepts
from draftfeed.schemas.protocol import FIRST_TENSOR_FRAME, MAX_HEADER_BYTES, PROTOCOL_NAME, SIGNATURE


def pack(header: BaseModel, buffers: Sequence[Any] = ()) -> list[Any]:
    """Frames for ``send_multipart(..., copy=False)``: signature, header JSON, then the buffers as they are."""
    return [SIGNATURE, header.model_dump_json().encode(), *buffers]


def with_request_id(frames: Sequence[Any], request_id: int) -> list[Any]:
    """The same message under another request id: a new header, the tensor frames as they are (a rank asking again)."""
    header = json.loads(frame_bytes(frames[1]))
    header["request_id"] = request_id
    return [frames[0], json.dumps(header, separators=(",", ":")).encode(), *frames[FIRST_TENSOR_FRAME:]]


def frame_bytes(frame: Any) -> bytes:
    """A received frame's bytes (a zmq.Frame, or bytes already)."""
    if type(frame) is bytes:
        return frame
    return frame.bytes if hasattr(frame, "bytes") else bytes(frame)


def unpack(frames: Sequence[Any], accepts: Accepts) -> tuple[Any, list[Any]]:
    """Check the signature and parse the header with ``accepts``; returns the header and the tensor frames.

    Raises MalformedMessage (ProtocolVersionMismatch for another protocol version) with what is wrong.
    """
    header, _raw, tensors = unpack_raw(frames, accepts)
    return header, tensors


def unpack_raw(frames: Sequence[Any], accepts: Accepts) -> tuple[Any, bytes, list[Any]]:
    """``unpack``, also returning the header's JSON as received (the broker forwards a request's without writing it again)."""
    if len(frames) < FIRST_TENSOR_FRAME:
        raise MalformedMessage(f"a draftfeed message has at least {FIRST_TENSOR_FRAME} frames; got {len(frames)}")
    signature = frame_bytes(frames[0])
    if signature != SIGNATURE:
        if signature.startswith(PROTOCOL_NAME + b"/"):
            raise ProtocolVersionMismatch(
                f"peer speaks {signature.decode(errors='replace')}, this process speaks {SIGNATURE.decode()}: "
                "run the same draftfeed version on ranks, broker and workers"
            )
        raise MalformedMessage(f"not a draftfeed message: first frame {signature[:32]!r} is not {SIGNATURE!r}")
    header_frame = frames[1]
    size = header_frame.buffer.nbytes if hasattr(header_frame, "buffer") else len(header_frame)
    if size > MAX_HEADER_BYTES:  # before the header is copied out of its frame
        raise MalformedMessage(f"header of {size} bytes is over the limit of {MAX_HEADER_BYTES} bytes")
    raw = frame_bytes(header_frame)
    try:
        header = accepts.validate_json(raw)
    except ValidationError as exc:
        raise MalformedMessage(f"invalid header: {_summarize(exc)}") from None
    return header, raw, list(frames[FIRST_TENSOR_FRAME:])


def message_type(frames: Sequence[Any]) -> str | None:
    """The ``type`` a draftfeed message's header names, without validating it; None if it names none."""
    if len(frames) < FIRST_TENSOR_FRAME or frame_bytes(frames[0]) != SIGNATURE:
        return None
    try:
        header = json.loads(frame_bytes(frames[1])[:MAX_HEADER_BYTES])
    except (ValueError, UnicodeDecodeError):
        return None
    kind = header.get("type") if isinstance(header, dict) else None
    return kind if isinstance(kind, str) else None


def _summarize(exc: ValidationError) -> str:
    parts = []
    for error in exc.errors()[:3]:
        where = ".".join(str(p) for p in error.get("loc", ())) or "header"
        parts.append(f"{where}: {error.get('msg')}")
    more = exc.error_count() - len(parts)
    return "; ".join(parts) + (f" (and {more} more)" if more > 0 else "")
