"""Which messages each socket accepts (the unions), and their validators: a peer that sends a worker's message to the
rank port gets a validation error, not a crash.
"""

from __future__ import annotations

from typing import Annotated, Any, get_args, get_origin

from pydantic import Field, TypeAdapter, ValidationError

from draftfeed.schemas.messages.common import Bye, ErrorReply, Goodbye, Heartbeat
from draftfeed.schemas.messages.data import Chunk, Failure, NixlGrant, NixlOpen, NixlReady, NixlWant, PairClose, PairOpen, Result
from draftfeed.schemas.messages.ranks import (
    Ack,
    Hello,
    ModelInfoQuery,
    ModelInfoReply,
    ServiceWorkers,
    SetVocabMapping,
    StatusQuery,
    StatusReply,
    Submit,
    UpdateReport,
    UpdateTarget,
    Welcome,
    Where,
    Whereabouts,
    WorkerKeys,
    WorkersGone,
)
from draftfeed.schemas.messages.weights import WeightsManifest, WeightsNixl, WeightsPair, WeightsPiece, WeightsPull
from draftfeed.schemas.messages.workers import (
    Computing,
    Dispatch,
    Done,
    Draining,
    ForgetMapping,
    ForgetRanks,
    Register,
    Registered,
    UpdateWeights,
    VocabMapping,
    WeightsUpdated,
    WorkerHeartbeat,
)

FrontendInbound = Annotated[
    Hello | Submit | SetVocabMapping | ModelInfoQuery | StatusQuery | Where | UpdateTarget | Heartbeat | Bye, Field(discriminator="type")
]


FrontendOutbound = Annotated[
    Welcome
    | Ack
    | ModelInfoReply
    | StatusReply
    | ErrorReply
    | Heartbeat
    | Goodbye
    | WorkersGone
    | WorkerKeys
    | ServiceWorkers
    | Whereabouts
    | UpdateReport,
    Field(discriminator="type"),
]


BackendInbound = Annotated[Register | Done | Computing | WorkerHeartbeat | Draining | WeightsUpdated | Bye, Field(discriminator="type")]


BackendOutbound = Annotated[
    Registered | Dispatch | VocabMapping | ForgetMapping | ForgetRanks | UpdateWeights | ErrorReply | Heartbeat | Goodbye,
    Field(discriminator="type"),
]


DataInbound = Annotated[Result | Chunk | Failure | PairOpen | PairClose | NixlOpen | NixlWant, Field(discriminator="type")]


# worker -> a weights publisher, and back (dataplane/weights/)
WeightsInbound = WeightsPull
WeightsOutbound = Annotated[WeightsManifest | WeightsNixl | WeightsPair | WeightsPiece | ErrorReply, Field(discriminator="type")]


# rank -> worker, back on the worker's connection to the rank's data socket
DataOutbound = Annotated[PairClose | NixlReady | NixlGrant, Field(discriminator="type")]


class Accepts:
    """The messages one socket accepts, validated from their JSON header.

    A header that begins ``{"type":"NAME"`` (as every draftfeed peer writes them) goes straight to that model's own
    validator, skipping the union's dispatch on ``type``; it checks exactly what the union checks for that type. Any
    other header, and any header that fails there, goes through the union, whose error is the one reported."""

    _PREFIX = b'{"type":"'

    def __init__(self, union: Any) -> None:
        self.adapter: TypeAdapter = TypeAdapter(union)
        members = get_args(union)[0] if get_origin(union) is Annotated else union
        models = get_args(members) or (members,)
        # Each model's own validator, called directly (``model_validate_json`` is a Python wrapper around it).
        self._by_type = {model.model_fields["type"].default.encode(): model.__pydantic_validator__ for model in models}
        self.types = frozenset(name.decode() for name in self._by_type)

    def validate_json(self, data: bytes) -> Any:
        if data.startswith(self._PREFIX):
            validator = self._by_type.get(data[9 : data.find(b'"', 9)])
            if validator is not None:
                try:
                    return validator.validate_json(data)
                except ValidationError:
                    pass  # the union's own validation says what is wrong
        return self.adapter.validate_json(data)


FRONTEND_INBOUND = Accepts(FrontendInbound)


FRONTEND_OUTBOUND = Accepts(FrontendOutbound)


BACKEND_INBOUND = Accepts(BackendInbound)


BACKEND_OUTBOUND = Accepts(BackendOutbound)


DATA_INBOUND = Accepts(DataInbound)


DATA_OUTBOUND = Accepts(DataOutbound)


WEIGHTS_INBOUND = Accepts(WeightsInbound)


WEIGHTS_OUTBOUND = Accepts(WeightsOutbound)
