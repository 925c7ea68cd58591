"""The target worker: pulls requests from the broker, runs the frozen target, pushes supervision to the rank.

Two threads: the broker link (broker_link.py) and this compute loop, which owns the engine and the
direct sockets to the ranks. A request that cannot be served is answered with a failure naming the
reason; the worker goes on serving.
"""

from __future__ import annotations

import logging
import os
import threading
import uuid
from dataclasses import dataclass
from typing import Any, Callable

import torch
import zmq

from draftfeed.consumers.broker_link import STOP, BrokerLink
from draftfeed.consumers.rank_links import RankLinks
from draftfeed.consumers.tasks.eagle3 import Eagle3Task, VocabMap
from draftfeed.consumers.validation import BadRequest, validate_batch, validate_vocab_mapping
from draftfeed.net import close_quietly, host_identity
from draftfeed.schemas.errors import MalformedMessage
from draftfeed.schemas.frames import pack, pack_tensors, unpack
from draftfeed.schemas.messages import BACKEND_OUTBOUND, Dispatch, Done, ErrorReply, Failure, ForgetMapping, Register, Result, VocabMapping
from draftfeed.schemas.tensor_codec import decode_tensors

log = logging.getLogger("draftfeed.worker")


@dataclass
class WorkerConfig:
    broker: str
    service: str
    capacity: int = 2
    name: str | None = None
    send_timeout_s: float = 60.0
    register_timeout_s: float = 60.0


class Worker:
    """Serves one task (EAGLE-3) of one target for one service."""

    def __init__(self, task: Eagle3Task, config: WorkerConfig) -> None:
        self.task = task
        self.config = config
        self.name = config.name or f"{host_identity()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self._mappings: dict[str, VocabMap | BadRequest] = {}
        self._stop = threading.Event()
        self.served = 0

    def registration(self) -> Register:
        return Register(
            worker=self.name,
            service=self.config.service,
            task="eagle3",
            engine=self.task.engine.name,
            info=self.task.info(),
            capacity=self.config.capacity,
            host=host_identity(),
            pid=os.getpid(),
        )

    def stop(self) -> None:
        self._stop.set()

    def run(self, on_ready: Callable[[], None] | None = None) -> None:
        context = zmq.Context()
        pipe_endpoint = f"inproc://draftfeed-worker-{uuid.uuid4().hex}"
        pipe = context.socket(zmq.PAIR)
        pipe.setsockopt(zmq.LINGER, 0)
        pipe.bind(pipe_endpoint)
        link = BrokerLink(context, self.config.broker, self.registration(), pipe_endpoint)
        ranks = RankLinks(context, self.config.send_timeout_s)
        link.start()
        try:
            if not link.registered.wait(self.config.register_timeout_s):
                raise TimeoutError(
                    f"worker {self.name}: no broker answered at {self.config.broker} within "
                    f"{self.config.register_timeout_s:.0f} s; is `draftfeed launch broker` running there?"
                )
            if link.failure is not None:
                raise RuntimeError(f"worker {self.name}: broker link failed: {link.failure}")
            if link.refused is not None:
                raise RuntimeError(f"worker {self.name}: the broker refused registration: {link.refused}")
            log.info("worker %s: serving %s on service %r", self.name, self.task.name, self.config.service)
            if on_ready is not None:
                on_ready()
            while not self._stop.is_set() and link.is_alive():
                if not pipe.poll(100):
                    continue
                frames = pipe.recv_multipart(copy=False)
                done = self._handle(frames, ranks)
                if done is not None:
                    pipe.send_multipart(pack(done))
        finally:
            if link.is_alive():
                pipe.send(STOP)
                link.join(timeout=5)
            ranks.close()
            close_quietly(pipe)
            context.term()

    # ------------------------------------------------------------ messages from the broker
    def _handle(self, frames: list[Any], ranks: RankLinks) -> Done | None:
        try:
            message, tensor_frames = unpack(frames, BACKEND_OUTBOUND)
        except MalformedMessage as exc:
            log.warning("worker %s: ignoring a malformed message from the broker: %s", self.name, exc)
            return None
        if isinstance(message, Dispatch):
            reply, ok = self._serve(message, tensor_frames)
            delivered = ranks.send(message.reply_to, reply)
            if ok and delivered:
                self.served += 1
            return Done(ticket=message.ticket, ok=ok and delivered)
        if isinstance(message, VocabMapping):
            self._mappings[message.digest] = self._load_mapping(message, tensor_frames)
        elif isinstance(message, ForgetMapping):
            self._mappings.pop(message.digest, None)
        elif isinstance(message, ErrorReply):
            log.warning("worker %s: the broker reports: %s", self.name, message.message)
        return None

    def _load_mapping(self, message: VocabMapping, tensor_frames: list[Any]) -> VocabMap | BadRequest:
        try:
            tensors = decode_tensors(message.tensors, tensor_frames)
            ids, mask = tensors["selected_token_ids"], tensors["selected_token_mask"]
            validate_vocab_mapping(ids, mask, self.task.shape.vocab_size)
        except (MalformedMessage, KeyError, BadRequest) as exc:
            return BadRequest(f"the vocab mapping is invalid: {exc}")
        device = self.task.engine.device
        return VocabMap(ids.to(device), mask.to(device))

    def _serve(self, dispatch: Dispatch, tensor_frames: list[Any]) -> tuple[list[Any], bool]:
        request = dispatch.request
        try:
            if dispatch.service != self.config.service:
                raise BadRequest(f"worker {self.name} serves {self.config.service!r}, not {dispatch.service!r}")
            tensors = decode_tensors(request.tensors, tensor_frames)
            if request.kind == "eagle3":
                out = self._eagle3(dispatch, tensors)
            elif request.kind == "input_embeddings":
                out = {"weight": self.task.engine.input_embeddings()}
            else:  # the message schema admits no other kind; kept for when it grows
                raise BadRequest(f"worker {self.name} does not serve requests of kind {request.kind!r}")
            frames = pack_tensors(Result, out, request_id=request.request_id, kind=request.kind, worker=self.name)
            return frames, True
        except (BadRequest, MalformedMessage) as exc:
            message = str(exc)
        except Exception as exc:  # the engine failed on this batch; the worker serves on
            log.exception("worker %s: request %d of %s failed", self.name, request.request_id, dispatch.client)
            message = f"{type(exc).__name__} in the {self.task.engine.name} engine: {exc}"
        return pack(Failure(request_id=request.request_id, worker=self.name, message=message)), False

    def _eagle3(self, dispatch: Dispatch, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        validate_batch(tensors, self.task.shape.vocab_size)
        vocab = None
        if dispatch.mapping_digest is not None:
            vocab = self._mappings.get(dispatch.mapping_digest)
            if vocab is None:
                raise BadRequest(f"worker {self.name} has not received vocab mapping {dispatch.mapping_digest}")
            if isinstance(vocab, BadRequest):
                raise vocab
        return self.task.compute(tensors["input_ids"], tensors["attention_mask"], tensors["loss_mask"], vocab)
