"""The target worker: pulls requests from the broker, runs the frozen target, pushes supervision to the rank.

Two threads: the broker link (broker_link.py: registration and heartbeats) and this compute loop, which
owns the engine and the direct sockets to the ranks. The link hands the loop what the broker sent through
an inbox (worker_session.py), parsed; the loop files all of it before it computes, so that a rank's departure
or a re-registration takes effect on queued work at once, and sends its own messages for the broker on a pipe.

Each answer goes to its rank through answer_delivery.py (on the plane chosen for that pair, or as frames), whose
outcome becomes the request's ``done`` for the broker.

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

from draftfeed.consumers.answer_delivery import AnswerDelivery, Outcome, Refused, Undelivered
from draftfeed.consumers.broker_link import BrokerLink
from draftfeed.consumers.computation import Computation, NonFiniteResult
from draftfeed.consumers.engines.base import RETRYABLE_ERRORS, EngineLost
from draftfeed.consumers.mappings import MissingMapping, WorkerMappings
from draftfeed.consumers.pair_report import PairReport
from draftfeed.consumers.settings import WorkerSettings
from draftfeed.consumers.tasks.base import Task
from draftfeed.consumers.worker_session import RESET, STOP, Inbox
from draftfeed.dataplane.choice import local_offer
from draftfeed.dataplane.frames.worker import RankLinks, SendResult
from draftfeed.dataplane.weights.worker import UpdateBroken, UpdateRefused
from draftfeed.dataplane.worker_pairs import PairPlanes
from draftfeed.net import close_quietly, host_identity, send_to_thread
from draftfeed.observe.worker_metrics import WorkerMetrics
from draftfeed.schemas.errors import BadRequest, CannotServe, MalformedMessage
from draftfeed.schemas.frames import pack
from draftfeed.schemas.messages import (
    Computing,
    Dispatch,
    Done,
    DoneOutcome,
    Draining,
    ForgetMapping,
    ForgetRanks,
    NonFiniteAt,
    Register,
    UpdateWeights,
    VocabMapping,
    WeightsUpdated,
    WorkerHeartbeat,
)

log = logging.getLogger("draftfeed.worker")


@dataclass
class _Queued:
    dispatch: Dispatch
    frames: list[Any]
    forgets: int  # the link's count of forget_ranks naming its rank when it was filed: a later one means the rank is gone


class Worker:
    """Serves one task of one target for one service."""

    def __init__(self, task: Task, settings: WorkerSettings) -> None:
        self.task = task
        self.settings = settings
        self.service = settings.service_name
        self.name = settings.name or f"{host_identity()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self._mappings = WorkerMappings(task.shape.vocab_size, task.engine.device)
        self._computation = Computation(
            task, self._mappings, self.name, self.service, settings.max_request_bytes, self.max_seq_len, check_finite=not settings.skip_finite_check
        )
        self._queue: deque[_Queued] = deque()
        self._stop = threading.Event()
        self._delivery: AnswerDelivery | None = None
        self._link: BrokerLink | None = None
        self._in_engine: int | None = None  # the ticket being computed
        self._announced: int | None = None  # the ticket the broker was last told comes next (a done's next_ticket)
        self._pair_report = PairReport()  # which pairs the next heartbeat reports
        self._stopping_since = 0.0
        self.served = 0
        # The version of the target's weights it serves, and where they came from (updates change both: _update).
        self.target_version = settings.target.target_version
        self.checkpoint = settings.target.path
        self.metrics = WorkerMetrics(self.name, self.service)
        self.metrics.spread_over(list(settings.target.devices) or [str(task.engine.device)])
        self.metrics.watch(
            in_flight=lambda: len(self._queue) + (self._in_engine is not None),
            registered=lambda: float(self._link is not None and self._link.is_alive() and self._link.registered.is_set()),
            target_version=lambda: float(self.target_version),
        )

    def health(self) -> str | None:
        """None while it can serve (registered with a broker, not stopping); else why not (for ``/health``)."""
        if self._stop.is_set():
            return "the worker is stopping"
        link = self._link
        if link is None or not link.is_alive():
            return "the worker is not running yet (loading its engine) or has lost its broker link"
        if not link.registered.is_set():
            return f"not registered with a broker at {self.settings.broker} yet"
        return None

    def registration(self) -> Register:
        return Register(
            worker=self.name,
            service=self.service,
            task=self.task.name,
            engine=self.task.engine.name,
            info=self.task.info(),
            supervision=self.task.supervision,
            logit_transform=self.task.logit_transform,
            capacity=self.settings.capacity,
            host=host_identity(),
            pid=os.getpid(),
            max_positions=self.max_seq_len,
            tensor_parallel=self.settings.target.tensor_parallel,
            devices=list(self.settings.target.devices),
            target_version=self.target_version,
            checkpoint=self.checkpoint,
        )

    @property
    def max_seq_len(self) -> int | None:
        """The longest row it takes: --max-seq-len, else the target's max_position_embeddings (None: no limit known)."""
        return self.settings.max_seq_len if self.settings.max_seq_len is not None else self.task.shape.max_positions

    def stop(self) -> None:
        """Stop taking work, hand back what is queued and exit; an answer being delivered gets --drain-timeout more
        (safe from a signal handler)."""
        if not self._stop.is_set():
            self._stopping_since = time.monotonic()
        self._stop.set()

    def _stats(self) -> WorkerHeartbeat:
        """The heartbeat (the link's thread, once per interval): stats, and the pairs whose status changed."""
        delivery = self._delivery
        pairs = delivery.pairs() if delivery else []
        return WorkerHeartbeat(
            rank_links=delivery.links() if delivery else 0,
            mappings=len(self._mappings),
            pair_count=len(pairs),
            pairs=self._pair_report.changes(pairs),
        )

    def run(self, on_ready: Callable[[], None] | None = None) -> None:
        context = zmq.Context()
        pipe_endpoint = f"inproc://draftfeed-worker-{uuid.uuid4().hex}"
        pipe = context.socket(zmq.PAIR)
        pipe.setsockopt(zmq.LINGER, 0)
        pipe.bind(pipe_endpoint)
        ranks = RankLinks(context, hwm=self.settings.capacity + 1, keys=self.settings.keys, max_frame_bytes=self.settings.max_request_bytes)
        planes = PairPlanes(
            self.name,
            local_offer(self.settings.data_plane, self.task.engine.device, encrypted=self.settings.keys is not None),
            send=lambda data_endpoint, frames: ranks.try_send(data_endpoint, frames) is SendResult.SENT,
            timeout_s=self.settings.pair_timeout_s,
            nixl_min_bytes=self.settings.nixl_min_bytes,
        )
        inbox = Inbox()
        self._link = link = BrokerLink(
            context,
            self.settings.broker,
            self.registration(),
            pipe_endpoint,
            self._stats,
            inbox,
            on_register=self._pair_report.reset,
            keys=self.settings.keys,
            max_frame_bytes=self.settings.max_request_bytes,
        )
        stopping_since = lambda: self._stopping_since if self._stop.is_set() else None  # noqa: E731
        self._delivery = delivery = AnswerDelivery(self.name, self.settings, ranks, planes, inbox.forgets, stopping_since)
        hooks = getattr(self.task.engine, "lost_hooks", None)
        if hooks is not None:  # an engine over several processes that can no longer compute: leave the broker at once
            hooks.append(lambda _why: link.leave_now())
        link.start()
        log.info("worker %s: registering with the broker at %s for service %r", self.name, self.settings.broker, self.service)
        try:
            if not self._await_registration(link):
                return
            log.info("worker %s: serving %s on service %r", self.name, self.task.name, self.service)
            if on_ready is not None:
                on_ready()
            self._serve(pipe, link, inbox)
            if link.refused is not None:
                raise CannotServe(f"worker {self.name}: the broker refused its registration: {link.refused}")
        finally:
            if send_to_thread(pipe, [STOP], link):
                link.join(timeout=5)
            delivery.close()
            close_quietly(pipe)
            context.term()

    def _await_registration(self, link: BrokerLink) -> bool:
        """Wait for the broker's welcome; False if the worker was told to stop first."""
        deadline = time.monotonic() + self.settings.register_timeout_s
        while not link.registered.wait(0.1):
            if self._stop.is_set():
                log.info("worker %s: stopped before a broker answered at %s", self.name, self.settings.broker)
                return False
            if time.monotonic() > deadline:
                secure = (
                    " With --secure, also check that --broker-key is that broker's public key and that this worker's key is on "
                    "the broker's --worker-keys list (the broker logs a refused key)."
                    if self.settings.keys is not None
                    else ""
                )
                raise CannotServe(
                    f"worker {self.name}: no broker answered at {self.settings.broker} within {self.settings.register_timeout_s:.0f} s "
                    f"(--register-timeout); is `draftfeed launch broker` running there, and is that its worker port (--backend)?{secure}"
                )
        if link.failure is not None:
            raise CannotServe(f"worker {self.name}: its link to the broker failed: {link.failure}")
        if link.refused is not None:
            raise CannotServe(f"worker {self.name}: the broker refused its registration: {link.refused}")
        return True

    def _serve(self, pipe: zmq.Socket, link: BrokerLink, inbox: Inbox) -> None:
        """The compute loop. One turn: move finished nixl writes on, file everything the link passed on (waiting up
        to 100 ms when idle), take what ranks sent on the data links, then compute and deliver one queued request
        and tell the broker it is done. Ends when stopped (handing back the queue) or when the link ends."""
        assert self._delivery is not None
        while link.is_alive() and not self._stop.is_set():
            self._delivery.finish_writes(block=False)
            wait_s = 0.0 if self._queue else 0.001 if self._delivery.writing else 0.1
            while (item := inbox.get(wait_s)) is not None:
                self._take(item, pipe)
                wait_s = 0.0
            self._delivery.take_from_ranks()
            if self._queue and not self._stop.is_set():
                queued = self._queue.popleft()
                done = self._serve_one(queued, pipe)
                self.metrics.answered(done.outcome)
                # The next request's ticket rides on this done: the broker knows what this worker computes next
                # without a message of its own (``computing`` goes only after an idle spell).
                self._announced = self._queue[0].dispatch.ticket if self._queue else None
                self._to_link(pipe, pack(done.model_copy(update={"next_ticket": self._announced})))
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
    def _take(self, item: tuple[Any, list[Any]] | str, pipe: zmq.Socket) -> None:
        """File one message from the link (parsed there), or its word that it registered afresh."""
        assert self._delivery is not None
        if item == RESET:
            self._queue.clear()  # the broker has requeued all of it
            self._announced = None
            self._mappings.clear()
            self._delivery.reset()  # the broker told the ranks this worker is gone: they closed their sides
            return
        message, tensor_frames = item
        if isinstance(message, Dispatch):
            self._delivery.remember(message.data_endpoint, message.reply_key)
            self._queue.append(_Queued(message, tensor_frames, self._delivery.forgets(message.data_endpoint)))
        elif isinstance(message, VocabMapping):
            self._mappings.load(message, tensor_frames)
        elif isinstance(message, ForgetMapping):
            self._mappings.forget(message.digest)
        elif isinstance(message, ForgetRanks):
            self._forget(message, pipe)
        elif isinstance(message, UpdateWeights):
            self._hand_back(pipe, f"worker {self.name} loads target version {message.target_version}", outcome="updating")
            self._to_link(pipe, pack(self._update(message)))

    def _update(self, message: UpdateWeights) -> WeightsUpdated:
        """Load new weights in place, between two requests, all or nothing; what it serves from now on, or why it
        keeps its old version (weight_updates.py). One whose pull broke off holds a mixture of versions and leaves. A
        later registration (after a broker restart) says the new version."""
        update = getattr(self.task.engine, "update_weights", None)
        started = time.perf_counter()
        problem: str | None = None
        if update is None:
            problem = (
                f"engine {self.task.engine.name} cannot load weights in place yet: restart the worker with --target PATH "
                f"--target-version {message.target_version}"
            )
        elif message.target_version <= self.target_version:
            problem = f"version {message.target_version} is not newer than the version it serves, {self.target_version}"
        else:
            try:
                keys = None if self.settings.keys is None else self.settings.keys.own
                update(message, check_finite=not self.settings.skip_finite_check, timeout_s=self.settings.update_timeout_s, keys=keys)
            except UpdateRefused as exc:
                problem = str(exc)
            except Exception as exc:  # broken off, or the engine lost, or a fault of its own: it may hold a mixture
                problem = f"{exc if isinstance(exc, UpdateBroken | EngineLost) else f'{type(exc).__name__}: {exc}'}; it leaves"
                log.error("worker %s: update to version %d broke off: %s", self.name, message.target_version, problem)
                self.stop()
        if problem is not None:
            log.warning(
                "worker %s: update to version %d refused, still serving %d: %s", self.name, message.target_version, self.target_version, problem
            )
            return WeightsUpdated(update=message.update, ok=False, target_version=self.target_version, checkpoint=self.checkpoint, message=problem)
        self.target_version, self.checkpoint = message.target_version, message.weights or f"published by {message.source}"
        assert self._link is not None
        self._link.session.registration = self.registration()
        log.info(
            "worker %s: serves target version %d from %s (loaded in %.2f s)",
            self.name,
            self.target_version,
            self.checkpoint,
            time.perf_counter() - started,
        )
        return WeightsUpdated(update=message.update, ok=True, target_version=self.target_version, checkpoint=self.checkpoint)

    def _forget(self, message: ForgetRanks, pipe: zmq.Socket) -> None:
        assert self._delivery is not None
        for address in message.ranks:
            self._delivery.forget(address.data_endpoint)
        gone = {address.rank for address in message.ranks}
        dropped = [q for q in self._queue if q.dispatch.rank in gone]
        if dropped:
            self._queue = deque(q for q in self._queue if q.dispatch.rank not in gone)
        for queued in dropped:
            self._to_link(pipe, pack(Done(ticket=queued.dispatch.ticket, outcome="undelivered", message="rank gone")))
        names = ", ".join(sorted(gone)[:4]) + (f" and {len(gone) - 4} more" if len(gone) > 4 else "")
        log.info("worker %s: rank %s gone; dropped %d of their queued requests", self.name, names, len(dropped))

    def _hand_back(self, pipe: zmq.Socket, reason: str, outcome: DoneOutcome = "draining") -> None:
        while self._queue:
            queued = self._queue.popleft()
            self._to_link(pipe, pack(Done(ticket=queued.dispatch.ticket, outcome=outcome, message=reason)))

    # ------------------------------------------------------------ serving one request
    def _serve_one(self, queued: _Queued, pipe: zmq.Socket) -> Done:
        """Compute and deliver one request; the done for the broker says how it went. The broker hears which request
        is in the engine before the engine starts: if the worker dies now, that one is charged with it."""
        dispatch, tensor_frames = queued.dispatch, queued.frames
        request = dispatch.request
        wanted = request.target_version
        if wanted is not None and not wanted.accepts(self.target_version):  # it changed since the broker dispatched it
            why = f"worker {self.name} serves target version {self.target_version} now, not {wanted.describe()}"
            return Done(ticket=dispatch.ticket, outcome="version_changed", message=why)
        self._in_engine = dispatch.ticket
        if self._announced != dispatch.ticket:  # the last done did not name it (the worker was idle): say it now
            self._to_link(pipe, pack(Computing(ticket=dispatch.ticket)))
        self._announced = None
        started = time.perf_counter()
        try:
            tensors = self._computation.compute(dispatch, tensor_frames)
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
        except NonFiniteResult as exc:
            self._in_engine = None
            return self._refuse_nonfinite(dispatch, exc)
        except (BadRequest, MalformedMessage) as exc:
            failure: str | None = str(exc)
        except Exception as exc:  # the engine failed on this batch; the worker serves on
            log.exception("worker %s: request %d of %s failed", self.name, request.request_id, dispatch.rank)
            failure = f"{type(exc).__name__} in the {self.task.engine.name} engine: {exc}"
        else:
            failure = None
        finally:
            self._in_engine = None
        if failure is not None:
            return self._fail(dispatch, failure)
        assert self._delivery is not None
        return self._done(dispatch, self._delivery.result(dispatch, tensors, queued.forgets, self.target_version), ok=True)

    def _fail(self, dispatch: Dispatch, message: str, nonfinite: NonFiniteAt | None = None) -> Done:
        """Tell the rank why its request could not be served."""
        assert self._delivery is not None
        return self._done(dispatch, self._delivery.failure(dispatch, message, nonfinite), ok=False)

    def _refuse_nonfinite(self, dispatch: Dispatch, exc: NonFiniteResult) -> Done:
        """Supervision with NaN or Inf is not sent: the rank is told where (it raises NonFiniteSupervision, or skips
        the batch), the worker counts it and serves on."""
        at = exc.at
        message = f"request {dispatch.request.request_id}: {exc}; it was not sent (a target that overflows its dtype, or a bad shard)"
        log.error("worker %s: %s of %s; the rank is told", self.name, message, dispatch.rank)
        self.metrics.nonfinite()
        return self._fail(dispatch, message, NonFiniteAt(tensor=at.tensor, index=list(at.index), value=at.value, layer=at.layer))

    def _done(self, dispatch: Dispatch, outcome: Outcome, *, ok: bool) -> Done:
        """The broker's done for how the answer went; a result that could not be sent goes as a failure instead."""
        if isinstance(outcome, Refused):
            return self._fail(dispatch, outcome.message)
        if isinstance(outcome, Undelivered):
            message = f"answer not delivered: rank {outcome.why.value}"
            if outcome.why is SendResult.STALLED:  # the rank stopped taking it: the broker sends the request again, once
                return Done(ticket=dispatch.ticket, outcome="stalled", message=f"{message} (it took nothing for --send-timeout)")
            return Done(ticket=dispatch.ticket, outcome="undelivered", message=message, rank_unreachable=outcome.rank_unreachable)
        if ok:
            self.served += 1
            self.metrics.delivered(outcome.plane, outcome.nbytes)
        return Done(ticket=dispatch.ticket, outcome="served" if ok else "failed")
