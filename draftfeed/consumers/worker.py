"""The target worker: pulls requests from the broker, runs the frozen target, pushes supervision to the rank.

Two threads: the broker link (broker_link.py: registration and heartbeats) and this compute loop, which
owns the engine and the direct sockets to the ranks. The loop files everything the link has passed on
before it computes, so that a rank's departure or a re-registration takes effect on queued work at once.

Supervision goes to each rank on the plane chosen for that pair (pair_planes.py): frames on the direct
socket, or a header on the socket and the tensors on the pair's own torch.distributed group, or (nixl)
a header on the socket after the tensors were written into a slot the rank granted; a pair that fails is
torn down and the answer goes again as frames.

A request that cannot be served is answered with a failure that says why, and the worker serves on.
An engine out of memory hands the request back to the broker, which gives it to another worker, and so
does a request naming a vocab mapping this worker lacks. On stop (SIGTERM) the worker tells the broker it
is draining, finishes what it is computing, hands back what it had queued, and exits.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import zmq

from draftfeed.consumers.broker_link import RESET, STOP, BrokerLink
from draftfeed.consumers.config import WorkerConfig
from draftfeed.consumers.engines.base import RETRYABLE_ERRORS, EngineLost
from draftfeed.consumers.mappings import MissingMapping, WorkerMappings
from draftfeed.consumers.nixl_senders import ARENAS, Write
from draftfeed.consumers.pair_planes import NixlLink, PairPlanes, PlaneRefused
from draftfeed.consumers.rank_links import Delivery, RankLinks
from draftfeed.consumers.tasks.base import Task
from draftfeed.consumers.validation import validate_batch
from draftfeed.dataplane.choice import local_offer
from draftfeed.dataplane.nixl_transport import NixlError, Region
from draftfeed.dataplane.pair_group import DataPlaneError, PairGroup, describe
from draftfeed.dataplane.tensor_codec import decode_tensors, pack_tensors, tensor_bytes
from draftfeed.net import close_quietly, host_identity, send_to_thread
from draftfeed.observe.worker_metrics import WorkerMetrics
from draftfeed.schemas.errors import BadRequest, CannotServe, MalformedMessage
from draftfeed.schemas.frames import pack, unpack
from draftfeed.schemas.messages import (
    BACKEND_OUTBOUND,
    DATA_OUTBOUND,
    Dispatch,
    Done,
    Draining,
    Failure,
    ForgetMapping,
    ForgetRank,
    NixlGrant,
    NixlReady,
    NixlWant,
    PairClose,
    Register,
    Result,
    VocabMapping,
    WorkerHeartbeat,
)
from draftfeed.schemas.protocol import nixl_notification
from draftfeed.schemas.tensor_specs import packed_layout

log = logging.getLogger("draftfeed.worker")


@dataclass
class _Queued:
    dispatch: Dispatch
    frames: list[Any]


class Worker:
    """Serves one task (EAGLE-3 or DSpark) of one target for one service."""

    def __init__(self, task: Task, config: WorkerConfig) -> None:
        self.task = task
        self.config = config
        self.name = config.name or f"{host_identity()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self._mappings = WorkerMappings(task.shape.vocab_size, task.engine.device)
        self._queue: deque[_Queued] = deque()
        self._stop = threading.Event()
        self._ranks: RankLinks | None = None
        self._planes: PairPlanes | None = None
        self._link: BrokerLink | None = None
        self._in_engine: int | None = None  # the ticket being computed (heartbeats say it)
        # The nixl writes in flight, oldest first, with their ranks' endpoints: at most one per staging arena.
        self._writing: deque[tuple[Write, str]] = deque()
        self._stopping_since = 0.0
        self.served = 0
        self.metrics = WorkerMetrics(self.name, config.service)
        self.metrics.spread_over(list(config.devices) or [str(task.engine.device)])
        self.metrics.watch(
            in_flight=lambda: len(self._queue) + (self._in_engine is not None),
            registered=lambda: float(self._link is not None and self._link.is_alive() and self._link.registered.is_set()),
        )

    def health(self) -> str | None:
        """None while it can serve (registered with a broker, not stopping); else why not (for ``/health``)."""
        if self._stop.is_set():
            return "the worker is stopping"
        link = self._link
        if link is None or not link.is_alive():
            return "the worker is not running yet (loading its engine) or has lost its broker link"
        if not link.registered.is_set():
            return f"not registered with a broker at {self.config.broker} yet"
        return None

    def registration(self) -> Register:
        return Register(
            worker=self.name,
            service=self.config.service,
            task=self.task.name,
            engine=self.task.engine.name,
            info=self.task.info(),
            supervision=self.task.supervision,
            logit_transform=self.task.logit_transform,
            capacity=self.config.capacity,
            host=host_identity(),
            pid=os.getpid(),
            max_positions=self.max_seq_len,
            tensor_parallel=self.config.tensor_parallel,
            devices=list(self.config.devices),
        )

    @property
    def max_seq_len(self) -> int | None:
        """The longest row it takes: --max-seq-len, else the target's max_position_embeddings (None: no limit known)."""
        return self.config.max_seq_len if self.config.max_seq_len is not None else self.task.shape.max_positions

    def stop(self) -> None:
        """Stop taking work, hand back what is queued and exit; an answer being delivered gets --drain-timeout more
        (safe from a signal handler)."""
        if not self._stop.is_set():
            self._stopping_since = time.monotonic()
        self._stop.set()

    def _stats(self) -> WorkerHeartbeat:
        return WorkerHeartbeat(
            in_engine=self._in_engine,
            rank_links=len(self._ranks) if self._ranks else 0,
            mappings=len(self._mappings),
            pairs=self._planes.statuses() if self._planes else [],
        )

    def run(self, on_ready: Callable[[], None] | None = None) -> None:
        context = zmq.Context()
        pipe_endpoint = f"inproc://draftfeed-worker-{uuid.uuid4().hex}"
        pipe = context.socket(zmq.PAIR)
        pipe.setsockopt(zmq.LINGER, 0)
        pipe.bind(pipe_endpoint)
        self._ranks = ranks = RankLinks(context, hwm=self.config.capacity + 1, keys=self.config.keys, max_frame_bytes=self.config.max_request_bytes)
        self._planes = PairPlanes(
            self.name,
            local_offer(self.config.data_plane, self.task.engine.device, encrypted=self.config.keys is not None),
            send=lambda endpoint, frames: ranks.try_send(endpoint, frames) is Delivery.SENT,
            timeout_s=self.config.pair_timeout_s,
        )
        self._link = link = BrokerLink(
            context,
            self.config.broker,
            self.registration(),
            pipe_endpoint,
            self._stats,
            keys=self.config.keys,
            max_frame_bytes=self.config.max_request_bytes,
        )
        link.start()
        log.info("worker %s: registering with the broker at %s for service %r", self.name, self.config.broker, self.config.service)
        try:
            if not self._await_registration(link):
                return
            log.info("worker %s: serving %s on service %r", self.name, self.task.name, self.config.service)
            if on_ready is not None:
                on_ready()
            self._serve(pipe, link)
            if link.refused is not None:
                raise CannotServe(f"worker {self.name}: the broker refused its registration: {link.refused}")
        finally:
            if send_to_thread(pipe, [STOP], link):
                link.join(timeout=5)
            while self._writing:
                self._finish_write(block=True)
            self._planes.shut_down()
            self._ranks.close()
            close_quietly(pipe)
            context.term()

    def _await_registration(self, link: BrokerLink) -> bool:
        """Wait for the broker's welcome; False if the worker was told to stop first."""
        deadline = time.monotonic() + self.config.register_timeout_s
        while not link.registered.wait(0.1):
            if self._stop.is_set():
                log.info("worker %s: stopped before a broker answered at %s", self.name, self.config.broker)
                return False
            if time.monotonic() > deadline:
                secure = (
                    " With --secure, also check that --broker-key is that broker's public key and that this worker's key is on "
                    "the broker's --worker-keys list (the broker logs a refused key)."
                    if self.config.keys is not None
                    else ""
                )
                raise CannotServe(
                    f"worker {self.name}: no broker answered at {self.config.broker} within {self.config.register_timeout_s:.0f} s "
                    f"(--register-timeout); is `draftfeed launch broker` running there, and is that its worker port (--backend)?{secure}"
                )
        if link.failure is not None:
            raise CannotServe(f"worker {self.name}: its link to the broker failed: {link.failure}")
        if link.refused is not None:
            raise CannotServe(f"worker {self.name}: the broker refused its registration: {link.refused}")
        return True

    def _serve(self, pipe: zmq.Socket, link: BrokerLink) -> None:
        """The compute loop. One turn: move finished nixl writes on, file everything the link passed on (waiting up
        to 100 ms when idle), take what ranks sent on the data links, then compute and deliver one queued request
        and tell the broker it is done. Ends when stopped (handing back the queue) or when the link ends."""
        while link.is_alive() and not self._stop.is_set():
            self._finish_write(block=False)
            wait_ms = 0 if self._queue else 1 if self._writing else 100
            while pipe.poll(wait_ms):
                self._take(pipe.recv_multipart(copy=False), pipe)
                wait_ms = 0
            self._take_from_ranks()
            if self._queue and not self._stop.is_set():
                queued = self._queue.popleft()
                done = self._serve_one(queued.dispatch, queued.frames, pipe)
                self.metrics.answered(done.outcome)
                self._to_link(pipe, pack(done))
        if self._stop.is_set():
            self._leave(pipe)

    def _to_link(self, pipe: zmq.Socket, frames: list[Any]) -> None:
        assert self._link is not None
        send_to_thread(pipe, frames, self._link)

    def _leave(self, pipe: zmq.Socket) -> None:
        """Stopping: no more work, and what was queued goes back to the broker now; the bye that follows (run's
        finally) makes the broker requeue whatever it had sent on its way here."""
        self._to_link(pipe, pack(Draining()))
        handed_back = len(self._queue)
        self._hand_back(pipe, "worker draining")
        log.info("worker %s: stopping after serving %d requests; %d queued went back to the broker", self.name, self.served, handed_back)

    # ------------------------------------------------------------ messages from the link
    def _take(self, frames: list[Any], pipe: zmq.Socket) -> None:
        """File one message from the link."""
        if len(frames) == 1 and frames[0].bytes == RESET:
            self._queue.clear()  # the broker has requeued all of it
            self._mappings.clear()
            if self._planes is not None:
                self._planes.close()  # the broker told the ranks this worker is gone: they closed their sides
            return
        try:
            message, tensor_frames = unpack(frames, BACKEND_OUTBOUND)
        except MalformedMessage as exc:
            log.warning("worker %s: ignoring a malformed message from the broker: %s", self.name, exc)
            return
        if isinstance(message, Dispatch):
            assert self._ranks is not None
            self._ranks.remember(message.reply_to, message.reply_key)
            self._queue.append(_Queued(message, tensor_frames))
        elif isinstance(message, VocabMapping):
            self._mappings.load(message, tensor_frames)
        elif isinstance(message, ForgetMapping):
            self._mappings.forget(message.digest)
        elif isinstance(message, ForgetRank):
            self._forget(message, pipe)

    def _take_from_ranks(self) -> None:
        """What ranks sent back on the data links: a rank that tore its side of a pair down, a nixl pair's
        readiness, a nixl grant."""
        assert self._ranks is not None and self._planes is not None
        for endpoint, frames in self._ranks.incoming():
            try:
                message, extra = unpack(frames, DATA_OUTBOUND)
            except MalformedMessage as exc:
                log.warning("worker %s: ignoring a malformed message from rank %s: %s", self.name, endpoint, exc)
                continue
            if isinstance(message, PairClose):
                self._planes.rank_closed(endpoint, message)
            elif isinstance(message, NixlReady):
                self._planes.nixl_ready(endpoint, message, extra)
            elif isinstance(message, NixlGrant):
                self._planes.granted(endpoint, message, extra)

    def _forget(self, message: ForgetRank, pipe: zmq.Socket) -> None:
        assert self._ranks is not None and self._planes is not None
        self._planes.forget(message.reply_to)
        self._ranks.forget(message.reply_to)
        dropped = [q for q in self._queue if q.dispatch.rank == message.rank]
        self._queue = deque(q for q in self._queue if q.dispatch.rank != message.rank)
        for queued in dropped:
            self._to_link(pipe, pack(Done(ticket=queued.dispatch.ticket, outcome="undelivered", message="rank gone")))
        log.info("worker %s: rank %s is gone; dropped %d of its queued requests", self.name, message.rank, len(dropped))

    def _hand_back(self, pipe: zmq.Socket, reason: str) -> None:
        while self._queue:
            queued = self._queue.popleft()
            self._to_link(pipe, pack(Done(ticket=queued.dispatch.ticket, outcome="draining", message=reason)))

    # ------------------------------------------------------------ serving one request
    def _serve_one(self, dispatch: Dispatch, tensor_frames: list[Any], pipe: zmq.Socket) -> Done:
        """Compute and deliver one request; the done for the broker says how it went. The broker hears which request
        is in the engine before the engine starts: if the worker dies now, that one is charged with it."""
        request = dispatch.request
        self._in_engine = dispatch.ticket
        self._to_link(pipe, pack(self._stats()))
        started = time.perf_counter()
        try:
            tensors = self._compute(dispatch, tensor_frames)
            self.metrics.computed(time.perf_counter() - started)
        except MissingMapping as exc:
            log.info(
                "worker %s: request %d of %s names a mapping it lacks (%s): handed back for it", self.name, request.request_id, dispatch.rank, exc
            )
            return Done(ticket=dispatch.ticket, outcome="missing_mapping", missing_mapping=exc.digest, message=str(exc))
        except EngineLost as exc:
            log.error("worker %s: request %d of %s goes back to the broker: %s", self.name, request.request_id, dispatch.rank, exc)
            self.stop()
            return Done(ticket=dispatch.ticket, outcome="draining", message=str(exc))
        except RETRYABLE_ERRORS as exc:
            log.warning("worker %s: request %d of %s handed back: %s", self.name, request.request_id, dispatch.rank, exc)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            return Done(ticket=dispatch.ticket, outcome="retry", message=f"{type(exc).__name__}: {exc}")
        except (BadRequest, MalformedMessage) as exc:
            failure: str | None = str(exc)
        except Exception as exc:  # the engine failed on this batch; the worker serves on
            log.exception("worker %s: request %d of %s failed", self.name, request.request_id, dispatch.rank)
            failure = f"{type(exc).__name__} in the {self.task.engine.name} engine: {exc}"
        else:
            failure = _over_limit(tensors, dispatch.max_result_bytes)
        finally:
            self._in_engine = None
        if failure is not None:
            return self._fail(dispatch, failure)
        try:
            return self._done(dispatch, self._deliver_result(dispatch, tensors), ok=True)
        except PlaneRefused as exc:
            return self._fail(
                dispatch, f"the data plane asked for cannot be had: {exc}; use data_plane='auto' (frames where a pair group cannot be had)"
            )

    def _fail(self, dispatch: Dispatch, message: str) -> Done:
        """Tell the rank why its request could not be served."""
        request = dispatch.request
        failure = Failure(request_id=request.request_id, token=request.token, worker=self.name, message=message)
        return self._done(dispatch, self._deliver(dispatch.reply_to, pack(failure)), ok=False)

    def _done(self, dispatch: Dispatch, delivery: Delivery, *, ok: bool) -> Done:
        if delivery is not Delivery.SENT:
            message = f"answer not delivered: rank {delivery.value}"
            return Done(ticket=dispatch.ticket, outcome="undelivered", message=message, rank_unreachable=delivery is Delivery.UNREACHABLE)
        if ok:
            self.served += 1
        return Done(ticket=dispatch.ticket, outcome="served" if ok else "failed")

    def _deliver_result(self, dispatch: Dispatch, tensors: dict[str, torch.Tensor]) -> Delivery:
        """Send the answer on the pair's group when it has a ready one, else (or when that fails) as frames."""
        assert self._planes is not None and self._link is not None
        request, endpoint = dispatch.request, dispatch.reply_to
        since = self._link.forgets(endpoint)  # a forget_rank from now on ends every wait of this delivery
        fields = dict(request_id=request.request_id, token=request.token, kind=request.kind, worker=self.name)
        pair = self._planes.group_for(endpoint, dispatch.rank, dispatch.data_plane)
        nbytes = tensor_bytes(tensors)
        if pair is not None and isinstance(pair[0], NixlLink):
            delivery = self._deliver_nixl(dispatch, tensors, pair[0], pair[1], fields, since)
            if delivery is not None:
                if delivery is Delivery.SENT:
                    self.metrics.delivered("nixl", nbytes)
                return delivery
        elif pair is not None and isinstance(pair[0], PairGroup):
            group, generation = pair
            header = Result(tensors=describe(tensors), plane="pair", generation=generation, **fields)
            delivery = self._deliver(endpoint, pack(header), since)
            if delivery is not Delivery.SENT:
                return delivery  # the rank is gone or unreachable: _deliver has released its pair
            try:
                group.send(tensors)
                self._planes.sent(endpoint)
                self.metrics.delivered(group.backend, nbytes)
                return Delivery.SENT
            except DataPlaneError as exc:
                self._planes.failed(endpoint, str(exc))  # the rank drops what it got; frames follow
            except Exception as exc:  # e.g. a device error copying the tensors: the group is out of step too
                log.exception("worker %s: sending on the pair group to %s failed", self.name, dispatch.rank)
                group.close()
                self._planes.failed(endpoint, f"{type(exc).__name__}: {exc}")
        delivery = self._deliver(endpoint, pack_tensors(Result, tensors, **fields), since)
        if delivery is Delivery.SENT:
            self.metrics.delivered("frames", nbytes)
        return delivery

    def _deliver_nixl(
        self, dispatch: Dispatch, tensors: dict[str, torch.Tensor], link: NixlLink, generation: int, fields: dict, since: int
    ) -> Delivery | None:
        """Ask the rank for a slot, write the answer into it, then send the header; None: send it as frames (no slot
        was granted, or the pair failed and was torn down)."""
        assert self._planes is not None
        endpoint = dispatch.reply_to
        specs = describe(tensors)
        offsets, total = packed_layout(specs)
        if total < max(1, self.config.nixl_min_bytes):
            return None
        want = self._planes.next_want()
        delivery = self._deliver(endpoint, pack(NixlWant(worker=self.name, generation=generation, want=want, nbytes=total)), since)
        if delivery is not Delivery.SENT:
            return delivery
        grant = self._await_grant(endpoint, generation, want, since)
        if grant is None:
            return None
        if grant.refused is not None:
            log.debug("worker %s: rank %s granted no slot (%s); this answer goes as frames", self.name, dispatch.rank, grant.refused)
            return None
        while len(self._writing) >= ARENAS:  # at most ARENAS in flight; a staged answer's arena must be free again
            self._finish_write(block=True)
        if not self._planes.is_ready(endpoint, generation):
            return None  # an earlier write failed and took this pair down
        link_ = self._link
        assert link_ is not None
        try:
            source = link.sender.prepare(tensors, offsets, total)
            slot = Region(grant.address, total, grant.device, "VRAM" if link.memory == "VRAM" else "DRAM")
            notification = nixl_notification(generation, grant.slot, want)
            gone = lambda: link_.forgets(endpoint) != since  # noqa: E731
            self._writing.append((link.sender.post(source, slot, link.remote_agent, notification, self.config.pair_timeout_s, gone), endpoint))
        except (NixlError, RuntimeError) as exc:
            self._planes.failed(endpoint, str(exc))
            while self._writing:  # the arenas' turn may be out of step with the writes now: let every write land first
                self._finish_write(block=True)
            return None
        # The header goes now; the rank uses the slot only once the write's notification is there too.
        delivery = self._deliver(endpoint, pack(Result(tensors=specs, plane="nixl", generation=generation, slot=grant.slot, **fields)), since)
        if delivery is Delivery.SENT:
            self._planes.sent(endpoint)
        return delivery

    def _finish_write(self, block: bool) -> None:
        """Check on the nixl writes in flight, oldest first, dropping those that have landed (``block``: wait for the
        oldest). One that failed takes its pair down (``pair_close``): the rank gives up on its answer and asks
        again, and the pair is rebuilt after the backoff."""
        assert self._planes is not None
        while self._writing:
            write, endpoint = self._writing[0]
            try:
                if block:
                    write.wait()
                elif not write.done():
                    return
            except NixlError as exc:
                self._planes.failed(endpoint, str(exc))
            self._writing.popleft()
            if block:
                return

    def _await_grant(self, endpoint: str, generation: int, want: int, since: int) -> NixlGrant | None:
        """The rank's grant for ``want``, or None when the pair closes, the rank is gone, or --pair-timeout passes
        (the pair is then torn down: a grant that comes later is never written to)."""
        assert self._ranks is not None and self._planes is not None and self._link is not None
        deadline = time.monotonic() + self.config.pair_timeout_s
        while True:
            self._take_from_ranks()
            grant = self._planes.take_grant(endpoint, generation, want)
            if grant is not None:
                return grant
            if not self._planes.is_ready(endpoint, generation) or self._link.forgets(endpoint) != since:
                return None
            if time.monotonic() > deadline:
                self._planes.failed(endpoint, f"no nixl_grant within {self.config.pair_timeout_s:.0f} s")
                return None
            # Writes in flight are checked every millisecond meanwhile: checking moves them on (over TCP above all).
            self._finish_write(block=False)
            self._ranks.socket(endpoint).poll(1 if self._writing else 50, zmq.POLLIN)

    def _deliver(self, endpoint: str, frames: list[Any], since: int | None = None) -> Delivery:
        """Send to a rank, trying until it takes the message, the broker reports it gone (the link counts its
        ``forget_rank``; ``since``: the count when this delivery began, default now), it was never reached within
        connect_timeout, or it took nothing for send_timeout."""
        assert self._ranks is not None and self._planes is not None and self._link is not None
        started = time.monotonic()
        forgets = self._link.forgets(endpoint) if since is None else since
        while True:
            delivery = self._ranks.try_send(endpoint, frames)
            if delivery is not Delivery.BLOCKED:
                return delivery
            if self._link.forgets(endpoint) != forgets:
                return Delivery.FORGOTTEN  # the forget_rank itself is filed next, with the rest of the link's messages
            waited = time.monotonic() - started
            if not self._ranks.ever_sent(endpoint) and waited > self.config.connect_timeout_s:
                # Never reached: a wrong or firewalled data endpoint. Fail fast for it from now on.
                log.error("worker %s: cannot reach rank data endpoint %s within %.0f s; not trying it again", self.name, endpoint, waited)
                self._planes.forget(endpoint)
                self._ranks.forget(endpoint)
                return Delivery.UNREACHABLE
            if self._stop.is_set() and time.monotonic() - self._stopping_since > self.config.drain_timeout_s:
                log.error(
                    "worker %s: stopping, and rank at %s took nothing for %.0f s (--drain-timeout): giving up on it", self.name, endpoint, waited
                )
                return Delivery.STALLED
            if waited > self.config.send_timeout_s:
                log.error("worker %s: rank at %s took nothing for %.0f s; dropping its link", self.name, endpoint, waited)
                self._planes.forget(endpoint)
                self._ranks.drop(endpoint)
                return Delivery.STALLED
            self._ranks.socket(endpoint).poll(100, zmq.POLLOUT)

    def _compute(self, dispatch: Dispatch, tensor_frames: list[Any]) -> dict[str, torch.Tensor]:
        request = dispatch.request
        if dispatch.service != self.config.service:
            raise BadRequest(f"worker {self.name} serves {self.config.service!r}, not {dispatch.service!r}")
        tensors = decode_tensors(request.tensors, tensor_frames, max_message_bytes=self.config.max_request_bytes)
        if request.kind == self.task.name:
            documents = validate_batch(tensors, self.task.shape.vocab_size, self.max_seq_len)
            vocab = self._mappings.get(request.mapping_digest)
            return self.task.compute(tensors["input_ids"], tensors["attention_mask"], tensors["loss_mask"], vocab, documents)
        if request.kind == "input_embeddings":
            return {"weight": self.task.engine.input_embeddings()}
        if request.kind == "output_embeddings":
            return {"weight": self._output_embedding_rows(tensors.get("rows"))}
        raise BadRequest(
            f"worker {self.name} serves {self.task.name} supervision, not {request.kind}: "
            f"connect a Remote{'Eagle3' if request.kind == 'eagle3' else 'DSpark'}Target to a {request.kind} service"
        )

    def _output_embedding_rows(self, rows: torch.Tensor | None) -> torch.Tensor:
        """The lm_head weight, or only the given rows (the draft vocab's, for the compact EAGLE-3 form)."""
        weight = self.task.engine.output_embeddings()
        if rows is None:
            return weight
        vocab = self.task.shape.vocab_size
        if rows.dtype != torch.int64 or rows.dim() != 1 or (rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= vocab)):
            raise BadRequest(f"rows must be a 1-D int64 tensor of ids in [0, {vocab})")
        return weight.index_select(0, rows.to(weight.device))


def _over_limit(tensors: dict[str, torch.Tensor], limit: int | None) -> str | None:
    """Why an answer is too big for its rank (``max_result_bytes`` from its hello), or None."""
    size = tensor_bytes(tensors)
    if limit is None or size <= limit:
        return None
    return (
        f"the answer is {size} bytes, over this rank's max_result_bytes of {limit}: "
        "raise max_result_bytes on the remote target, or send smaller batches"
    )
