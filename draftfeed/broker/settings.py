"""The broker's settings: each default is stated here once (the CLI's flags read them from here)."""

from __future__ import annotations

from dataclasses import dataclass, field

from draftfeed.schemas.messages import Liveness
from draftfeed.schemas.protocol import DEFAULT_MAX_FRAME_BYTES, DEFAULT_MAX_REQUEST_BYTES


@dataclass(frozen=True)
class BrokerSettings:
    # Seconds between heartbeats to and from every peer; peers adopt it at hello / registration.
    heartbeat_interval_s: float = 1.0
    # Intervals a peer may stay silent before it counts as dead (the liveness period: liveness_s).
    liveness: int = 5
    # Requests one service may queue; past it ranks are told to send again later.
    max_queued_per_service: int = 4096
    # Most requests one rank may have at the broker: a rank's hello asking for a larger credit window is refused.
    max_queued_per_rank: int = 256
    # Workers a request may be tried on before its rank gets an error.
    max_attempts: int = 3
    # Largest frame either broker socket takes: libzmq drops a peer that sends a bigger one before allocating it.
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
    # Tensor bytes one request may declare, per service (others: max_request_bytes); checked before queueing.
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    service_max_request_bytes: dict[str, int] = field(default_factory=dict)
    # On SIGTERM, how long the broker waits for requests at workers to finish before it exits.
    drain_timeout_s: float = 30.0

    def request_limit(self, service: str) -> int:
        return self.service_max_request_bytes.get(service, self.max_request_bytes)

    @property
    def liveness_message(self) -> Liveness:
        return Liveness(heartbeat_interval_s=self.heartbeat_interval_s, liveness=self.liveness)

    @property
    def liveness_s(self) -> float:
        """The liveness period in seconds: a peer silent for longer counts as dead."""
        return self.heartbeat_interval_s * self.liveness
