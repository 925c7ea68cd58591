"""The broker's settings: each default and description is stated here once. ``draftfeed launch broker`` makes a flag
of every field (draftfeed/launch/flags.py)."""

from __future__ import annotations

from typing import ClassVar

from draftfeed.schemas.messages import Liveness
from draftfeed.schemas.protocol import DEFAULT_MAX_FRAME_BYTES, DEFAULT_MAX_REQUEST_BYTES
from draftfeed.schemas.settings import Settings, setting


class BrokerSettings(Settings):
    GROUP: ClassVar[str] = "settings (BrokerSettings)"

    heartbeat_interval_s: float = setting(1.0, "seconds between heartbeats to and from every peer; peers adopt it at hello and registration")
    liveness: int = setting(5, "heartbeat intervals a peer may stay silent before it counts as dead (the liveness period)")
    max_queued_per_service: int = setting(4096, "requests one service may queue; past it ranks are told to send again later", flag="--max-queued")
    max_queued_per_rank: int = setting(
        256, "most requests one rank may have queued or at workers; a rank asking for a larger prefetch (credit) window is refused"
    )
    max_attempts: int = setting(3, "workers a request may be tried on before the rank gets an error")
    churn_window_s: float = setting(
        300.0,
        "seconds after evidence that workers die for reasons of their own (one died holding no request, a batch charged with a death "
        "was served, a worker taken for dead came back) during which workers' deaths count against no batch",
    )
    max_frame_bytes: int = setting(
        DEFAULT_MAX_FRAME_BYTES, "largest frame the broker takes from any peer; a peer sending more is disconnected before the frame is allocated"
    )
    max_request_bytes: int = setting(
        DEFAULT_MAX_REQUEST_BYTES, "tensor bytes one request may declare, for every service without its own limit; checked before queueing"
    )
    service_max_request_bytes: dict[str, int] = setting(
        default_factory=dict, help="the request limit of one service (repeatable)", parse="service_limit", metavar="SERVICE=BYTES"
    )
    drain_timeout_s: float = setting(30.0, "on SIGTERM, seconds to wait for requests at workers to finish before exiting")

    def request_limit(self, service: str) -> int:
        return self.service_max_request_bytes.get(service, self.max_request_bytes)

    @property
    def liveness_message(self) -> Liveness:
        return Liveness(heartbeat_interval_s=self.heartbeat_interval_s, liveness=self.liveness)

    @property
    def liveness_s(self) -> float:
        """The liveness period in seconds: a peer silent for longer counts as dead."""
        return self.heartbeat_interval_s * self.liveness
