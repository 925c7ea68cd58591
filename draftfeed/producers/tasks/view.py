"""What a rank's client says of itself, read from its source without changing it: batches in flight, its name and
data socket, its data planes and receive pool, what its connection dropped, and why no answer comes."""

from __future__ import annotations

from concurrent.futures import Future

from draftfeed.producers.rank_session import ConnectionStats
from draftfeed.producers.sources import Source
from draftfeed.schemas.messages import PairOpen


class RankView:
    """The read-only views of RemoteTarget (its ``_source``, set by the client's constructor; None once closed
    or before it is made)."""

    _source: Source | None = None
    _closed: bool = True

    @property
    def in_flight(self) -> int:
        """Batches of this rank sent and not yet answered (reads from the store included)."""
        return self._source.in_flight if self._source is not None else 0

    @property
    def peak_in_flight(self) -> int:
        return self._made().peak_in_flight

    @property
    def oldest_request_s(self) -> float:
        """How long this rank's oldest unanswered request to the workers has waited (0: none waits); next to the
        liveness period, a stuck one shows (the metric ``draftfeed_rank_oldest_request_seconds``)."""
        return self._source.oldest_request_s if self._source is not None else 0.0

    @property
    def data_endpoint(self) -> str:
        """Where this rank's data socket listens: workers send supervision there ('' in replay: there is none)."""
        return self._made().data_endpoint

    @property
    def rank_id(self) -> str:
        """This rank's name at the broker (as ``draftfeed status`` lists it); in replay a name of its own."""
        return self._made().rank_id

    def data_planes(self) -> dict[str, str]:
        """The open pair groups and nixl pairs of this rank: worker name -> "backend generation"."""
        return self._made().data_planes()

    def nixl_pool(self) -> dict[str, int]:
        """The nixl plane's receive pool: open pairs, slots, bytes registered, slots your tensors still view, quarantined."""
        return self._made().nixl_pool()

    def partial_answers(self) -> dict[str, int]:
        """Answers arriving in pieces not yet whole: how many, the bytes allocated for them, and the pieces dropped
        (of answers no longer awaited, or freed when they could not complete)."""
        return self._made().partial_answers()

    def pair_group(self, worker: str) -> PairOpen | None:
        """How the pair group with ``worker`` was opened (backend, generation, its rendezvous store), or None."""
        return self._made().pair_group(worker)

    @property
    def connection_stats(self) -> ConnectionStats:
        """Duplicate, foreign and malformed answers dropped, resyncs after broker restarts, busy retries."""
        return self._source.stats if self._source is not None else ConnectionStats()

    def _made(self) -> Source:
        """The source, closed or not (what it counted stays readable)."""
        assert self._source is not None  # set in __init__, or the constructor raised
        return self._source

    def _why_no_answer(self, future: Future | None = None) -> str:
        return self._source.why_no_answer(future) if self._source is not None else "the rank is closed"

    def _health(self) -> str | None:
        """None while a broker is heard and the service has a worker (for ``/health`` of metrics_port)."""
        return self._source.health() if self._source is not None and not self._closed else "the rank is closed"
