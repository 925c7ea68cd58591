"""What the broker refuses before it takes anything on: a rank's hello, a request, a worker's registration.

Pure functions of the message and what the broker holds; each returns the refusal (its error code and a
message that says what to change) or None.
"""

from __future__ import annotations

from typing import Any

from draftfeed.broker.mappings import MappingTable
from draftfeed.broker.records import RankRecord, ServiceRecord
from draftfeed.broker.settings import BrokerSettings
from draftfeed.schemas.errors import MalformedMessage
from draftfeed.schemas.messages import TASKS, ErrorCode, Hello, Register, Submit
from draftfeed.schemas.tensor_specs import check_frames, declared_bytes

Refusal = tuple[ErrorCode, str]


def refuse_hello(peer: bytes, hello: Hello, settings: BrokerSettings, service: ServiceRecord) -> Refusal | None:
    if hello.rank.encode() != peer:
        return "refused", f"hello names rank {hello.rank!r}, but this connection is {peer!r}: a rank speaks only for itself"
    if hello.window > settings.max_queued_per_rank:
        return "over_limit", (
            f"rank {hello.rank} asks for a prefetch window of {hello.window}, over this broker's cap of "
            f"{settings.max_queued_per_rank} requests per rank (--max-queued-per-rank): use prefetch_depth "
            f"{settings.max_queued_per_rank} or less"
        )
    if hello.expect is not None and service.info is not None and service.info != hello.expect:
        return "mismatch", (
            f"service {service.name!r} serves another target than this rank checked: "
            f"{hello.expect.describe_mismatch(service.info, 'rank expects', 'workers serve')}"
        )
    return None


def held(rank: RankRecord) -> str:
    """The rank's requests the broker holds, by id and where each is: at a worker, queued, or parked."""
    parked = {id(pending) for pending in rank.parked}
    places = {
        request_id: "parked" if id(pending) in parked else ("at a worker" if pending.ticket >= 0 else "queued")
        for request_id, pending in rank.requests.items()
    }
    return ", ".join(f"{request_id} {place}" for request_id, place in places.items())


def refuse_submit(
    broker: str,
    rank: RankRecord,
    submit: Submit,
    frames: list[Any],
    settings: BrokerSettings,
    service: ServiceRecord,
    mappings: MappingTable,
) -> Refusal | None:
    limit = settings.request_limit(service.name)
    declared = declared_bytes(submit.tensors)
    if declared is not None and declared > limit:
        return "refused", (
            f"request {submit.request_id} declares {declared} bytes of tensors, over the limit of service {service.name!r} ({limit} "
            f"bytes): send smaller batches, or start the broker with --service-max-request-bytes {service.name}=BYTES"
        )
    try:
        check_frames(submit.tensors, frames, max_message_bytes=limit)
    except MalformedMessage as exc:
        return "refused", str(exc)
    if submit.mapping_digest is not None and submit.mapping_digest not in mappings:
        return "unknown_mapping", (
            f"broker {broker} holds no vocab mapping {submit.mapping_digest}, which request {submit.request_id} names: "
            "send the mapping, then the request again"
        )
    window = rank.hello.window
    if rank.outstanding >= window and len(rank.parked) >= window:
        # Busy, not refused: a rank within its window can be here through no fault of its own (an answer lost on
        # its way is asked for again while the lost request waits for its worker's done), and the next dones
        # make room. The request is not held meanwhile, so a rank that ignores its window costs the broker nothing.
        return "busy", (
            f"rank {rank.hello.rank} has {len(rank.requests)} requests held ({held(rank)}) and its prefetch window is "
            f"{window}: send again once results have come"
        )
    positions = _positions(submit)
    limit_positions = service.max_positions if positions is not None else None
    if positions is not None and limit_positions is not None and positions > limit_positions:
        return "refused", (
            f"request {submit.request_id} has rows of {positions} positions; the target of service {service.name!r} takes at most "
            f"{limit_positions} (its workers' limit, the target's max_position_embeddings): send rows of {limit_positions} tokens or less"
        )
    if service.info is not None and submit.kind in TASKS and submit.kind != service.info.task:
        return "refused", f"service {service.name!r} serves {service.info.task} supervision, not {submit.kind}: connect to a {submit.kind} service"
    if len(service.queue) >= settings.max_queued_per_service:
        return "busy", f"service {service.name!r} has {len(service.queue)} requests queued, its limit: send again later"
    return None


def _positions(submit: Submit) -> int | None:
    """The row length of a supervision request (its input_ids' second dimension)."""
    if submit.kind not in TASKS:
        return None
    spec = next((spec for spec in submit.tensors if spec.name == "input_ids"), None)
    return spec.shape[1] if spec is not None and len(spec.shape) == 2 else None


def refuse_registration(peer: bytes, register: Register, service: ServiceRecord) -> str | None:
    if register.worker.encode() != peer:
        return f"registration names worker {register.worker!r}, but this connection is {peer!r}"
    if service.info is not None and register.info != service.info:
        return (
            f"worker {register.worker} on {register.host} serves another target than service {service.name!r}: "
            f"{register.info.describe_mismatch(service.info, 'worker has', 'service has')}"
        )
    return None
