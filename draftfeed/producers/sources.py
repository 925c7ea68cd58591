"""Where a rank's requests go, chosen once when the rank is made: the broker, or a store in front of it.

``BrokerSource`` asks the service's workers through the broker (one ``Connection``). ``StoredSource`` puts a
supervision store (docs/store.md) in front of one: ``replay`` answers every batch from the store and has no
broker at all, ``cache`` answers the batches the store holds and asks the broker for the others, recording
them, and ``record`` asks the broker for every batch and records it. ``RemoteTarget`` holds one source and
never asks which; the sources return futures, which it waits for.
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from draftfeed.dataplane.choice import local_offer
from draftfeed.dataplane.frames.codec import pack_tensors
from draftfeed.net import host_identity
from draftfeed.producers.answers import Finish
from draftfeed.producers.connection import Connection
from draftfeed.producers.rank_session import ConnectionStats
from draftfeed.producers.requests import RequestKind
from draftfeed.producers.settings import RankSettings
from draftfeed.producers.stored import StoredSupervision
from draftfeed.schemas.errors import RemoteTargetError
from draftfeed.schemas.frames import pack
from draftfeed.schemas.messages import (
    AnyTargetInfo,
    LogitTransform,
    ModelInfoQuery,
    PairOpen,
    SetVocabMapping,
    StatusQuery,
    Submit,
    VersionWanted,
)
from draftfeed.security.curve import PeerKeys
from draftfeed.store.identity import StoreIdentity
from draftfeed.store.store import SupervisionStore

log = logging.getLogger("draftfeed.producer")


@dataclass(frozen=True)
class Served:
    """What a source serves: the target, who serves it (for messages), its workers' forms and logit transform."""

    info: AnyTargetInfo
    origin: str  # "service 'x'" or "the store at PATH"
    verb: str  # what the origin does with it: "serves" or "holds"
    workers: list[str]  # none in replay
    forms: list[str]
    logit_transform: LogitTransform | None
    target_versions: list[int] = field(default_factory=list)  # each worker's, in the order of ``workers``


def done(value: Any) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future


class BrokerSource:
    """The service's workers, through the broker."""

    def __init__(self, connection: Connection, service: str, request_timeout: float, version_wanted: VersionWanted | None = None) -> None:
        self.connection = connection
        self.service = service
        self._request_timeout = request_timeout
        self.version_wanted = version_wanted  # the target versions its requests take (None: any); the client may change it

    @property
    def rank_id(self) -> str:
        return self.connection.rank_id

    def await_workers(self, wait_s: float) -> None:
        """A service no worker serves yet: say so, and wait up to ``wait_s`` (wait_for_workers) for its first one."""
        connection, session, service = self.connection, self.connection.session, self.service
        if session.has_workers.is_set():
            return
        served = ", ".join(f"{name} ({count} workers)" for name, count in session.services.items() if name != service and count)
        served = f"it serves {served}" if served else "it serves no service yet"
        if wait_s <= 0:
            raise RemoteTargetError(f"no worker serves service {service!r} at the broker at {connection.broker}: {served} (wait_for_workers=0)")
        log.warning("draftfeed: no worker serves service %r yet (%s); waiting up to %g s (wait_for_workers)", service, served, wait_s)
        if not session.has_workers.wait(wait_s):
            raise RemoteTargetError(
                f"no worker of service {service!r} registered at the broker at {connection.broker} within {wait_s:g} s "
                f"(wait_for_workers): {served}; start a worker with --service {service}, or raise wait_for_workers"
            )

    def served(self) -> Future:
        """The service's target, asked of the broker (which answers from its workers' registrations)."""

        def served(reply: Any, _tensors: dict[str, Any]) -> Served:
            origin = f"service {self.service!r}"
            return Served(
                reply.info, origin, "serves", list(reply.workers), list(reply.supervision), reply.logit_transform, list(reply.target_versions)
            )

        return self.connection.request(lambda rid, _token: pack(ModelInfoQuery(request_id=rid)), served, RequestKind.QUERY)

    def checked(self, info: Any) -> None:
        """The rank has checked the service's target: the broker pins the service to it (also after a restart)."""
        self.connection.expect(info)

    def bind(self, identity: Callable[[], StoreIdentity]) -> None:
        """Before the first batch: nothing to set up without a store."""

    def submit(self, kind: str, tensors: dict[str, torch.Tensor], finish: Finish, mapping: str | None = None) -> Future:
        """A request for the workers (a batch's supervision, a target weight): holds a prefetch slot until answered."""
        return self.connection.request(
            lambda rid, token: pack_tensors(
                Submit, tensors, request_id=rid, kind=kind, token=token, mapping_digest=mapping, target_version=self.version_wanted
            ),
            finish,
            RequestKind.BATCH,
            mapping=mapping,
            timeout_s=self._request_timeout,
        )

    def supervise(self, task: str, sent: dict[str, torch.Tensor], finish: Finish, mapping: str | None) -> tuple[Future, bool | None]:
        """A batch's supervision, and whether the store answered it (None: no store)."""
        return self.submit(task, sent, finish, mapping), None

    def weight(self, kind: str, rows: torch.Tensor | None) -> Future:
        """A target weight (input or output embeddings; ``rows`` of it only, for a vocab mapping)."""
        return self.submit(kind, {} if rows is None else {"rows": rows}, lambda _reply, received: received["weight"])

    def set_mapping(self, ids: torch.Tensor, mask: torch.Tensor, digest: str, previous: str | None) -> Future:
        tensors = {"selected_token_ids": ids, "selected_token_mask": mask}
        return self.connection.request(
            lambda rid, _token: pack_tensors(SetVocabMapping, tensors, request_id=rid, digest=digest),
            lambda _reply, _tensors: None,
            RequestKind.SET_MAPPING,
            mapping=digest,
        )

    def status(self, also: Callable[[], dict[str, Any]] = dict) -> Future:
        """The broker's status document, with what ``also`` gives when it comes."""
        return self.connection.request(
            lambda rid, _token: pack(StatusQuery(request_id=rid)), lambda reply, _: {**reply.status, **also()}, RequestKind.STATUS
        )

    def why_no_answer(self, future: Future | None = None) -> str:
        """What is known of why no answer comes: the broker gone or silent, the service without workers, or neither;
        and where the broker last said the request of ``future`` was (requests.py, ``describe``)."""
        broker = self.connection.session.describe_broker()
        if not broker.startswith("the broker was heard"):
            why = broker
        elif self.connection.session.service_workers == 0:
            why = f"no worker serves the service now ({broker})"
        else:
            why = f"its {self.connection.session.service_workers} workers have not answered ({broker})"
        seen = self.connection.requests.describe(getattr(future, "request_id", None))
        return f"{why}; {seen}" if seen is not None else why

    def health(self) -> str | None:
        """None while a broker is heard and the service has a worker."""
        return None if self.connection.session.has_workers.is_set() else f"service {self.service!r} has no worker yet"

    @property
    def in_flight(self) -> int:
        return self.connection.in_flight

    @property
    def peak_in_flight(self) -> int:
        return self.connection.peak_in_flight

    @property
    def oldest_request_s(self) -> float:
        """How long its oldest unanswered request has waited (requests.py, ``oldest_s``)."""
        return self.connection.requests.oldest_s()

    @property
    def data_endpoint(self) -> str:
        return self.connection.data_endpoint

    @property
    def stats(self) -> ConnectionStats:
        return self.connection.session.stats

    def data_planes(self) -> dict[str, str]:
        return self.connection.receivers.pairs.planes() | self.connection.receivers.nixl.planes()

    def nixl_pool(self) -> dict[str, int]:
        return self.connection.receivers.nixl.stats()

    def partial_answers(self) -> dict[str, int]:
        chunks = self.connection.receivers.chunks
        return {"answers": len(chunks), "bytes": chunks.held_bytes, "pieces_dropped": chunks.pieces_dropped}

    def pair_group(self, worker: str) -> PairOpen | None:
        return self.connection.receivers.pairs.opened(worker)

    def flush(self, timeout_s: float) -> None:
        """Nothing is recorded without a store."""

    def close(self, timeout_s: float) -> None:
        self.connection.close()


class StoredSource:
    """A store in front of the broker (``cache``, ``record``), or in its place (``replay``: ``broker`` is None)."""

    def __init__(self, stored: StoredSupervision, broker: BrokerSource | None, replay_id: str, version_wanted: VersionWanted | None) -> None:
        self.stored = stored
        self.store = stored.store
        self.broker = broker
        self._replay_id = replay_id
        self._version_wanted = version_wanted

    @property
    def version_wanted(self) -> VersionWanted | None:
        """The target versions its requests take, from the store and from the workers alike (None: any)."""
        return self._version_wanted

    @version_wanted.setter
    def version_wanted(self, wanted: VersionWanted | None) -> None:
        self._version_wanted = wanted
        if self.broker is not None:
            self.broker.version_wanted = wanted

    @property
    def rank_id(self) -> str:
        return self.broker.rank_id if self.broker is not None else f"replay-{self._replay_id}"

    def _live(self, what: str) -> BrokerSource:
        if self.broker is None:
            raise RemoteTargetError(f"{what} needs a broker, and this rank replays the store at {self.store.path} without one")
        return self.broker

    def served(self) -> Future:
        if self.broker is not None:
            return self.broker.served()
        identity = self.store.identity  # replay: what the store was recorded from
        assert identity is not None  # a store opened for replay has its store.json
        return done(Served(identity.target, f"the store at {self.store.path}", "holds", [], list(identity.forms), identity.logit_transform))

    def checked(self, info: Any) -> None:
        if self.broker is not None:
            self.broker.checked(info)

    def bind(self, identity: Callable[[], StoreIdentity]) -> None:
        """Before the first batch: the store learns what it is used for."""
        if not self.store.bound:
            self.store.bind(identity())

    def supervise(self, task: str, sent: dict[str, torch.Tensor], finish: Finish, mapping: str | None) -> tuple[Future, bool | None]:
        key = self.store.key(sent)
        answered = self.stored.answer(key, self._version_wanted, finish)
        if answered is not None:
            return answered, True
        recording = self.stored.recording(key, int(sent["attention_mask"].sum()), finish)
        return self._live(f"asking for {task}").submit(task, sent, recording, mapping), False

    def weight(self, kind: str, rows: torch.Tensor | None) -> Future:
        name = kind if rows is None else f"{kind}_rows"  # the rows of the vocab mapping the store is bound to
        weight = self.store.weight(name)
        if weight is not None:
            return done(weight)
        if self.broker is None:
            raise RemoteTargetError(
                f"the store at {self.store.path} holds no {name.replace('_', ' ')} (store_mode='replay' has no worker to ask): "
                "record with a rank that asks for it (get_input_embeddings() / get_output_embeddings()), or use store_mode='cache'"
            )

        def keep(_reply: Any, received: dict[str, torch.Tensor]) -> torch.Tensor:
            self.store.put_weight(name, received["weight"])
            return received["weight"]

        return self.broker.submit(kind, {} if rows is None else {"rows": rows}, keep)

    def set_mapping(self, ids: torch.Tensor, mask: torch.Tensor, digest: str, previous: str | None) -> Future:
        if self.store.bound and digest != previous:
            raise ValueError(
                f"set_vocab_mapping: the store at {self.store.path} is in use with the mapping this rank had before its "
                "first batch; set the mapping before the first batch, or use another store"
            )
        return self.broker.set_mapping(ids, mask, digest, previous) if self.broker is not None else done(None)

    def status(self) -> Future:
        """The broker's status (none in replay), and under "store" this rank's store."""
        also = lambda: {"store": self.stored.describe()}  # noqa: E731
        return self.broker.status(also) if self.broker is not None else done(also())

    def await_workers(self, wait_s: float) -> None:
        if self.broker is not None:
            self.broker.await_workers(wait_s)

    def why_no_answer(self, future: Future | None = None) -> str:
        return self.broker.why_no_answer(future) if self.broker is not None else f"reading the store at {self.store.path} is this slow"

    def health(self) -> str | None:
        return self.broker.health() if self.broker is not None else None

    @property
    def in_flight(self) -> int:
        """Batches sent and not yet answered, reads from the store included."""
        return (self.broker.in_flight if self.broker is not None else 0) + self.stored.reading

    @property
    def peak_in_flight(self) -> int:
        return self.broker.peak_in_flight if self.broker is not None else 0

    @property
    def oldest_request_s(self) -> float:
        return self.broker.oldest_request_s if self.broker is not None else 0.0

    @property
    def data_endpoint(self) -> str:
        return self.broker.data_endpoint if self.broker is not None else ""

    @property
    def stats(self) -> ConnectionStats:
        return self.broker.stats if self.broker is not None else ConnectionStats()

    def data_planes(self) -> dict[str, str]:
        return self.broker.data_planes() if self.broker is not None else {}

    def nixl_pool(self) -> dict[str, int]:
        return self.broker.nixl_pool() if self.broker is not None else {}

    def partial_answers(self) -> dict[str, int]:
        return self.broker.partial_answers() if self.broker is not None else {}

    def pair_group(self, worker: str) -> PairOpen | None:
        return self.broker.pair_group(worker) if self.broker is not None else None

    def flush(self, timeout_s: float) -> None:
        """Write what was recorded so far into the store for good (its shard and index line)."""
        self.store.flush(timeout_s)

    def close(self, timeout_s: float) -> None:
        """Write what the store has still to record, then close the broker's connection (also if that write failed)."""
        try:
            self.stored.close(timeout_s)
        finally:
            if self.broker is not None:
                self.broker.close(timeout_s)


Source = BrokerSource | StoredSource


def open_source(
    settings: RankSettings,
    broker: str | None,
    service: str,
    task: str,
    keys: PeerKeys | str | Path | None,
    data_endpoint: str | None,
    device: torch.device | None,
) -> Source:
    """The source ``settings`` ask for: the store first (one that cannot be opened fails before anything connects),
    then the connection to the broker (none in replay). What was opened is closed again if the rest fails."""
    replaying = settings.store_mode_in_force == "replay"
    stored = None
    if settings.store is not None:
        local_id = f"{host_identity()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"  # its shard folder (and name in replay)
        opened = SupervisionStore(settings.store, settings.store_mode_in_force, local_id, settings.store_shard_bytes, settings.store_queue_batches)
        stored = StoredSupervision(opened, max(settings.prefetch_depth, 1), settings.request_timeout)
        if replaying:
            return StoredSource(stored, None, local_id, settings.version_wanted)
    assert broker is not None  # RemoteTarget refuses broker=None unless it replays
    try:
        rank_keys = PeerKeys.resolve(keys, "rank")
        connection = Connection(
            broker,
            service,
            max(settings.prefetch_depth, 1),
            task=task,
            data_endpoint=data_endpoint,
            connect_timeout_s=settings.connect_timeout,
            data_plane=local_offer(settings.data_plane, device, encrypted=rank_keys is not None),
            keys=rank_keys,
            max_result_bytes=settings.max_result_bytes,
            nixl_pool_bytes=settings.nixl_pool_bytes,
        )
    except BaseException:
        if stored is not None:
            stored.close(settings.request_timeout)
        raise
    live = BrokerSource(connection, service, settings.request_timeout, settings.version_wanted)
    return StoredSource(stored, live, local_id, settings.version_wanted) if stored is not None else live
