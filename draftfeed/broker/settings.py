"""The broker's settings: each default and description is stated here once. ``draftfeed launch broker`` makes a flag
of every field (draftfeed/launch/flags.py): its name from the field's (or ``metadata["flag"]``), its ``--help`` from
``metadata["help"]``, its default from the field."""

from __future__ import annotations

from dataclasses import dataclass, field

from draftfeed.schemas.messages import Liveness
from draftfeed.schemas.protocol import DEFAULT_MAX_FRAME_BYTES, DEFAULT_MAX_REQUEST_BYTES


@dataclass(frozen=True)
class BrokerSettings:
    heartbeat_interval_s: float = field(
        default=1.0, metadata={"help": "seconds between heartbeats to and from every peer; peers adopt it at hello and registration"}
    )
    liveness: int = field(
        default=5,
        metadata={"help": "heartbeat intervals a peer may stay silent before it counts as dead (the liveness period)"},
    )
    max_queued_per_service: int = field(
        default=4096,
        metadata={"flag": "--max-queued", "help": "requests one service may queue; past it ranks are told to send again later"},
    )
    max_queued_per_rank: int = field(
        default=256,
        metadata={"help": "most requests one rank may have queued or at workers; a rank asking for a larger prefetch (credit) window is refused"},
    )
    max_attempts: int = field(default=3, metadata={"help": "workers a request may be tried on before the rank gets an error"})
    max_frame_bytes: int = field(
        default=DEFAULT_MAX_FRAME_BYTES,
        metadata={"help": "largest frame the broker takes from any peer; a peer sending more is disconnected before the frame is allocated"},
    )
    max_request_bytes: int = field(
        default=DEFAULT_MAX_REQUEST_BYTES,
        metadata={"help": "tensor bytes one request may declare, for every service without its own limit; checked before queueing"},
    )
    service_max_request_bytes: dict[str, int] = field(
        default_factory=dict,
        metadata={"help": "the request limit of one service (repeatable)", "parse": "service_limit", "metavar": "SERVICE=BYTES"},
    )
    drain_timeout_s: float = field(default=30.0, metadata={"help": "on SIGTERM, seconds to wait for requests at workers to finish before exiting"})

    def request_limit(self, service: str) -> int:
        return self.service_max_request_bytes.get(service, self.max_request_bytes)

    @property
    def liveness_message(self) -> Liveness:
        return Liveness(heartbeat_interval_s=self.heartbeat_interval_s, liveness=self.liveness)

    @property
    def liveness_s(self) -> float:
        """The liveness period in seconds: a peer silent for longer counts as dead."""
        return self.heartbeat_interval_s * self.liveness
