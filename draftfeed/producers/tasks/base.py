"""What every task's client on the rank shares: RemoteTarget, a frozen target served by draftfeed workers.

A task's client (one module a task beside this one) names its task, its supervision dataclass and its target info,
and says how the fields of its supervision are made from what the worker sent (``_from_wire``); sending batches,
prefetching, waiting, the store, weights and status are all here, once. Method and parameter names follow NeMo
AutoModel's remote target backend, so a rank written against it calls these classes unchanged.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterable, Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import Any, ClassVar, Generic, TypeVar

import torch
from torch import nn

from draftfeed.contract.supervision import Supervision
from draftfeed.dataplane.frames.codec import tensor_bytes
from draftfeed.observe.http import ObserveServer
from draftfeed.observe.rank_metrics import RankMetrics
from draftfeed.producers.outgoing import batch_arguments, outgoing_batch, takes_arguments_of
from draftfeed.producers.resumable import ResumableIteration
from draftfeed.producers.settings import RankSettings
from draftfeed.producers.sources import Served, Source, open_source
from draftfeed.producers.tasks.view import RankView
from draftfeed.producers.tasks.weights import TargetWeights
from draftfeed.producers.waits import wait_for
from draftfeed.schemas.errors import NonFiniteSupervision, RemoteTargetError
from draftfeed.schemas.messages import AnyTargetInfo, VersionPolicy, VersionWanted
from draftfeed.schemas.protocol import DEFAULT_HTTP_HOST
from draftfeed.security.curve import PeerKeys
from draftfeed.store.identity import StoreIdentity

log = logging.getLogger("draftfeed.producer")
_DEFAULTS = RankSettings()
Sup = TypeVar("Sup", bound=Supervision)
Info = TypeVar("Info", bound=AnyTargetInfo)


class RemoteTarget(RankView, Generic[Sup, Info]):
    """A frozen target served by the workers of one service, through the broker at ``broker``.

    ``prefetch_depth`` is the one knob: at most that many batches of this rank are queued or in flight
    anywhere in the pipeline (0 means one at a time, fetched only when asked for). It sets the rank's
    credit window and its sockets' high-water marks.

    ``data_plane`` says how supervision may reach this rank (docs/data-planes.md): ``"auto"`` (the default)
    takes NCCL from a worker on the same machine when both sides hold CUDA tensors (``device`` a CUDA
    device here), NIXL where both sides have it installed (``pip install 'draftfeed[nixl]'``; not between
    machines under ``keys``: NIXL traffic is not encrypted), and frames otherwise; ``"frames"``, ``"nccl"``,
    ``"gloo"`` and ``"nixl"`` force one. The worker's own setting and this one decide together; a pair that
    cannot use its plane for an answer sends it as frames. ``nixl_pool_bytes`` bounds the receive memory the
    nixl plane registers; a batch you hold keeps its slot, which is reused only once its tensors are freed.

    ``keys`` connects to a ``--secure`` broker (docs/security.md): a ``PeerKeys``, or a folder from
    ``draftfeed keys generate`` (its rank.key_secret and broker.key); by default the folder named by
    ``$DRAFTFEED_KEYS``, if set. The rank's own data socket then admits only the service's workers.

    ``max_result_bytes`` is the largest answer (all its tensors) this rank takes: workers answer a bigger one
    with an error, and its data socket refuses bigger frames before allocating them.

    ``store`` is a folder of recorded supervision (docs/store.md), used as ``store_mode`` says: ``"record"``
    (workers compute every batch, and it is written there too), ``"replay"`` (every batch is read from it; no
    broker is contacted, ``broker`` may be None, and a batch it lacks is an error naming its key) or ``"cache"``
    (the default: batches it holds are read from it, the others computed and written back). Every mode yields
    the same supervision, bit for bit, in the same order and with the same prefetch depth. ``store_shard_bytes``
    and ``store_queue_batches`` bound the memory recording uses.
    """

    TASK: ClassVar[str]
    SUPERVISION: ClassVar[type[Supervision]]
    INFO: ClassVar[type]
    PACKED_REFUSAL: ClassVar[str | None] = None  # why this task takes no packed rows (None: it takes them)

    def __init__(
        self,
        broker: str | None,
        service: str,
        prefetch_depth: int = _DEFAULTS.prefetch_depth,
        *,
        request_timeout: float = _DEFAULTS.request_timeout,
        connect_timeout: float = _DEFAULTS.connect_timeout,
        wait_for_workers: float = _DEFAULTS.wait_for_workers,
        device: torch.device | str | None = None,
        data_endpoint: str | None = None,
        wait_log_interval: float = _DEFAULTS.wait_log_interval,
        data_plane: str = _DEFAULTS.data_plane,
        keys: PeerKeys | str | Path | None = None,
        max_result_bytes: int = _DEFAULTS.max_result_bytes,
        nixl_pool_bytes: int = _DEFAULTS.nixl_pool_bytes,
        metrics_port: int | None = _DEFAULTS.metrics_port,
        store: str | Path | None = _DEFAULTS.store,
        store_mode: str | None = _DEFAULTS.store_mode,
        store_shard_bytes: int = _DEFAULTS.store_shard_bytes,
        store_queue_batches: int = _DEFAULTS.store_queue_batches,
        on_nonfinite: str = _DEFAULTS.on_nonfinite,
        min_target_version: int | None = _DEFAULTS.min_target_version,
        version_policy: str | None = _DEFAULTS.version_policy,
    ) -> None:
        given = locals()  # the parameters above that are settings: RankSettings checks them, with its own words
        settings = RankSettings.checked(type(self).__name__, **{name: given[name] for name in RankSettings.model_fields if name in given})
        if broker is None and settings.store_mode_in_force != "replay":
            raise ValueError(f"{type(self).__name__}: broker=None works only with store_mode='replay'; give the broker's address")
        self.settings = settings
        self.service = service
        self.prefetch_depth = settings.prefetch_depth
        self.request_timeout = settings.request_timeout
        self.device = torch.device(settings.device) if settings.device is not None else None
        self.wait_log_interval = settings.wait_log_interval
        self._source: Source | None = None
        self._closed = False
        self._observer: ObserveServer | None = None
        self._served: Served | None = None
        self._weights = TargetWeights(self._fetch_weight)
        self._source = open_source(settings, broker, service, self.TASK, keys, data_endpoint, self.device)
        try:
            self.metrics = RankMetrics(
                self.rank_id, service, lambda: self.in_flight, lambda: self.connection_stats, oldest=lambda: self.oldest_request_s
            )
            if settings.metrics_port is not None:
                self._observer = ObserveServer(DEFAULT_HTTP_HOST, settings.metrics_port, self._health, lambda: self.metrics.registry, "metrics_port")
            self._source.await_workers(settings.wait_for_workers)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------ setup
    def model_info(self) -> Info:
        """num_hidden_layers, hidden_size, vocab_size and the layer ids of the service's target (asked once; in
        replay, what the store was recorded from)."""
        return self._served_target().info  # type: ignore[return-value]

    def worker_versions(self) -> dict[str, int]:
        """The target version each worker of the service serves now, by worker name (asked of the broker each time;
        docs/versions.md)."""
        served = self._wait(self._opened().served(), "the model info (is a worker for this service running?)")
        return dict(zip(served.workers, served.target_versions, strict=False))

    def _served_target(self) -> Served:
        if self._served is None:
            served = self._wait(self._opened().served(), "the model info (is a worker for this service running?)")
            if not isinstance(served.info, self.INFO):
                raise ValueError(f"{served.origin} {served.verb} {served.info.task} supervision; {type(self).__name__} needs {self.TASK} supervision")
            self._served = served
            self._opened().checked(served.info)
        return self._served

    def check_target_info(self, expected: Info) -> None:
        """Raise ValueError naming the service, its workers and each mismatched field, unless the service's
        target is ``expected``. Once checked, the broker refuses any worker of another target, later ones too."""
        served = self._served_target()
        mismatch = expected.describe_mismatch(served.info, "expected", "served")
        if mismatch:
            workers = f" (workers {', '.join(served.workers)})" if served.workers else ""
            raise ValueError(f"{served.origin}{workers} {served.verb} another target: {mismatch}")

    def get_input_embeddings(self) -> nn.Embedding:
        """The target's input embedding as a frozen ``nn.Embedding`` ([V, H] weight), fetched once."""
        return self._weights.embedding("input_embeddings")

    def get_output_embeddings(self) -> nn.Embedding:
        """The target's output embedding (lm_head) weight [V, H] as a frozen ``nn.Embedding``, fetched once."""
        return self._weights.embedding("output_embeddings")

    def get_lm_head(self) -> nn.Linear:
        """The target's lm_head as a frozen ``nn.Linear`` without bias, its weight [V, H] the output embedding's (the same
        tensor, fetched once): NeMo's EAGLE-1/2 and ViSpec recipes start their draft's head from it."""
        return self._weights.lm_head()

    def _fetch_weight(self, kind: str, rows: torch.Tensor | None = None) -> torch.Tensor:
        weight = self._wait(self._opened().weight(kind, rows), f"the {kind.replace('_', ' ')}")
        return weight.to(self.device) if self.device is not None else weight

    # ------------------------------------------------------------ supervision
    def generate_batch_async(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        loss_mask: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        seq_lens: torch.Tensor | None = None,
        doc_remaining: torch.Tensor | None = None,
        **mm_inputs: torch.Tensor,
    ) -> Future:
        """Send one batch; the future yields its supervision. Blocks while the prefetch window is full.

        A packed batch (several documents a row, as NeMo AutoModel packs them) gives ``seq_lens`` [B, max_docs] and
        may give ``position_ids`` and ``doc_remaining`` [B, S]; attention then stays within each document
        (docs/contract.md, "Packed rows"), and the supervision carries the three back as given. A packed batch that
        does not add up is refused here with what is wrong. An image-text target's batch gives its image processor's
        tensors as keyword arguments (``pixel_values``, ``image_grid_thw``, ``mm_token_type_ids``, ``token_type_ids``,
        ...: whatever the target's forward takes by name; docs/contract.md, "Image-text targets"); they go to the
        worker as they are, in unpacked batches only. The tensors are sent from their own memory: do not modify
        them until the future is done."""
        if seq_lens is not None and self.PACKED_REFUSAL is not None:
            raise ValueError(f"{type(self).__name__}.generate_batch: {self.PACKED_REFUSAL}")
        sent, kept = outgoing_batch(input_ids, attention_mask, loss_mask, position_ids, seq_lens, doc_remaining, mm_inputs)
        self._before_submit()

        def finish(_reply: Any, received: dict[str, torch.Tensor]) -> Sup:
            own = {name: t for name, t in {**sent, **kept}.items() if name not in mm_inputs}  # the images are not supervision
            if self.device is not None:
                received = {name: t.to(self.device, non_blocking=True) for name, t in received.items()}
                own = {name: t.to(self.device, non_blocking=True) for name, t in own.items()}
            made = {**own, **self._from_wire(received, own)}
            supervision = self.SUPERVISION(**{name: made[name] for name in self._field_names() if name in made})
            supervision.target_version = _reply.target_version  # a worker's result, or the store's record (StoredReply)
            self.metrics.received(tensor_bytes(received))
            return supervision  # type: ignore[return-value]

        future, from_store = self._opened().supervise(self.TASK, sent, finish, self._mapping_digest)
        if from_store is not None:
            self.metrics.from_store(from_store)
        return future

    def _before_submit(self) -> None:
        """Setup before the first batch (runs on the caller's thread): a store learns what it is used for."""
        self._opened().bind(self._store_identity)

    def _store_identity(self) -> StoreIdentity:
        served = self._served_target()
        return StoreIdentity(
            task=self.TASK,
            target=served.info,
            forms=sorted(served.forms),
            logit_transform=served.logit_transform,
            mapping_digest=self._mapping_digest,
        )

    def _from_wire(self, received: dict[str, torch.Tensor], own: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The supervision fields made from what the worker sent (``received``) and the rank's own tensors of the batch
        (``own``: input_ids, attention_mask, loss_mask and the packing arguments as given), on the thread that takes
        the result. A field it returns replaces the rank's own of that name; of the rest, only the supervision
        dataclass's fields are kept."""
        return {name: received[name] for name in self.SUPERVISION.WIRE_FIELDS}

    @classmethod
    def _field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls.SUPERVISION))  # type: ignore[arg-type]

    @takes_arguments_of(generate_batch_async)
    def generate_batch(self, *args: Any, **kwargs: Any) -> Sup:
        """Supervision of one batch, blocking (the arguments as for ``generate_batch_async``)."""
        return self.wait(self.generate_batch_async(*args, **kwargs))

    def wait(self, future: Future) -> Sup:
        """The supervision of a ``generate_batch_async`` future: waits at most request_timeout, saying every few
        seconds what it waits for, and counts the wait (draftfeed_rank_wait_seconds)."""
        started = time.monotonic()
        supervision = self._wait(future, "supervision")
        self.metrics.waited(time.monotonic() - started)
        return supervision

    def want_target_version(self, minimum: int, policy: VersionPolicy | None = None) -> None:
        """From the next batch sent on, take supervision of target version ``minimum`` or newer (``policy``: at-least,
        exact or latest; None: the one in force, at-least at first). Batches already sent keep what they asked for.
        Each supervision says the version that computed it (``target_version``; docs/versions.md)."""
        source = self._opened()
        current = source.version_wanted
        wanted = VersionWanted(minimum=minimum, policy=policy or (current.policy if current else "at-least"))
        if (problem := self.settings.store_version_problem(wanted)) is not None:
            raise ValueError(f"{type(self).__name__}.want_target_version: {problem}")
        source.version_wanted = wanted

    def iterate(self, dataloader: Iterable[Mapping[str, Any]], min_target_version: int | None = None) -> ResumableIteration[Sup]:
        """Yield ``(batch, supervision)`` in the dataloader's order, keeping ``prefetch_depth`` batches in flight.

        Each batch is a mapping with input_ids, attention_mask and loss_mask, and position_ids, seq_lens and
        doc_remaining where it holds them (a packed batch), and the image inputs of docs/contract.md's "Image-text
        targets" where it holds them; it is yielded as it came, other keys included.

        The iterator's ``state_dict()`` is the dataloader's state as of the last batch it yielded, not as of the last
        batch drawn (which is ``prefetch_depth`` ahead); ``load_state_dict(state)`` on a new ``iterate()`` of a fresh
        dataloader, before its first batch, goes on after that batch, and the batches that were in flight are asked
        for again (docs/reliability.md, "Stopping and resuming training"). It needs a dataloader that saves its state
        (torchdata's ``StatefulDataLoader``); with a store, taking the state also writes what the store recorded.
        ``min_target_version``: ``want_target_version`` first.
        """
        if min_target_version is not None:
            self.want_target_version(min_target_version)
        return ResumableIteration(
            dataloader,
            lambda batch: self.generate_batch_async(**batch_arguments(batch)),
            self.wait,
            self.prefetch_depth,
            before_state=self._write_store,
            on_skipped=self._skipped if self.settings.on_nonfinite == "skip" else None,
            on_resumed_version=self._resumed_at_version,
        )

    def _resumed_at_version(self, version: int) -> None:
        """A resumed iterate() trained on target ``version`` last: a rank that takes versions asks for it or newer."""
        wanted = self._opened().version_wanted
        if wanted is not None and wanted.minimum < version and wanted.policy != "exact":
            self.want_target_version(version)

    def _skipped(self, error: NonFiniteSupervision) -> None:
        """A batch iterate() leaves out (on_nonfinite="skip"): said and counted."""
        log.warning("draftfeed rank %s: a batch is skipped (on_nonfinite='skip'): %s", self.rank_id, error)
        self.metrics.skipped_nonfinite()

    def _write_store(self) -> None:
        """Have the store write what it recorded so far (a closed rank's store has written everything)."""
        if not self._closed:
            self._made().flush(self.request_timeout)

    # ------------------------------------------------------------ plumbing
    # The vocab mapping this rank's batches are computed with (its digest; None: the identity), named by every batch.
    _mapping_digest: str | None = None

    def _wait(self, future: Future, what: str) -> Any:
        """The future's result; says every few seconds what it waits for and why; raises after request_timeout."""
        return wait_for(future, what, self.service, self.request_timeout, self.wait_log_interval, self._why_no_answer, lambda: self.in_flight)

    def status(self) -> dict[str, Any]:
        """The broker's status document (services, workers, ranks, queues), and under "store" this rank's store
        (path, mode, batches, hits, misses) when it has one; in replay only the latter."""
        return dict(self._wait(self._opened().status(), "the broker status"))

    def close(self) -> None:
        """Write what the store has still to record, then release the sockets and the IO thread; outstanding
        requests fail with TargetClosed. A failed last write into the store is raised, after all is released."""
        if getattr(self, "_closed", True):
            return
        self._closed = True
        source = self._source
        try:
            if source is not None:
                source.close(self.settings.request_timeout)
        finally:
            if getattr(self, "_observer", None) is not None:
                self._observer.close()
                self._observer = None

    def _opened(self) -> Source:
        if self._closed:
            raise RemoteTargetError(f"{type(self).__name__} of service {self.service!r} is closed")
        return self._made()

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
