"""The leader of a tensor-parallel worker: an Engine whose every call runs on all the worker's processes.

It starts the followers of its machine (ranks 1 .. per node - 1), builds rank 0 of the engine in the worker's own
process, and waits until every rank has loaded the target, those the other machines' nodes start included
(node.py). Each call goes to the followers first, then runs here; the engine's collectives line up across the ranks
and this process keeps what the call returns. A weight is gathered once and kept.

Across machines (``nodes``) rank 0's store listens on node 0's --master-addr, and what the other nodes need to join
is in it: the plan they check theirs against (a node that differs says why there, and rank 0 stops with that
line), where the calls come from and where to say they are alive. Every follower says so once a second (watch.py).

A follower that ends, or falls silent, while the worker runs leaves the group unable to compute: the worker is
told to stop (``lost_hooks``, then ``on_lost``, by default a SIGTERM to this process, which drains as a SIGTERM
does), a call in progress raises EngineLost (its request goes back to the broker, not charged), and if this
process is stuck in a collective that never returns, it exits after ``LOST_GRACE_S`` with its followers killed (loss.py).
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch

from draftfeed.consumers.engines.base import Capture, Engine, EngineLost, ForwardOutput
from draftfeed.consumers.engines.parallel.commands import (
    Ack,
    CaptureSpec,
    Forward,
    GoOn,
    LeaderChannel,
    Prepare,
    Stop,
    Update,
    Weight,
    local_endpoint,
)
from draftfeed.consumers.engines.parallel.followers import FollowerProcesses
from draftfeed.consumers.engines.parallel.group import COLLECTIVE_TIMEOUT_S, LOAD_TIMEOUT_S, host_rendezvous, interface_towards
from draftfeed.consumers.engines.parallel.loss import EngineLoss, LossReported, sigterm_self
from draftfeed.consumers.engines.parallel.ranked import build_ranked
from draftfeed.consumers.engines.parallel.rendezvous import DEFAULT_JOIN_TIMEOUT_S, MEETING_KEY, PLAN_KEY, await_nodes, refusal
from draftfeed.consumers.engines.parallel.spec import LOOPBACK, FollowerSpec, Meeting, TargetSpec, place_at
from draftfeed.consumers.engines.parallel.watch import LeaderWatch
from draftfeed.consumers.nodes import NodePlan
from draftfeed.consumers.weight_updates import UpdateRefused
from draftfeed.contract.packing import Documents
from draftfeed.net import free_port
from draftfeed.schemas.messages import UpdateWeights
from draftfeed.security.keys import KeyPair

log = logging.getLogger("draftfeed.worker")

# After rank 0 raised in a call, how long the others get to say they raised too (they end the call at the same point).
ACK_TIMEOUT_S = 10.0


def spec_of(capture: Capture) -> CaptureSpec:
    return CaptureSpec(layer_ids=list(capture.layer_ids), embeddings=capture.embeddings, final_hidden=capture.final_hidden, logits=capture.logits)


PARALLEL_IMAGES_REFUSAL = "a tensor-parallel worker (--tensor-parallel N) takes no image inputs yet: serve image-text batches with --tensor-parallel 1, or --device-map auto"


class TensorParallelEngine(LossReported):
    """``engine`` over ``devices``, one process a device, this one rank 0; with ``nodes``, ``devices`` are node 0's
    and the other nodes start the rest (``plan``: what they must agree with, nodes.fingerprint)."""

    def __init__(
        self,
        engine: str,
        target: str,
        devices: Sequence[str],
        dtype: str = "auto",
        options: dict[str, Any] | None = None,
        on_lost: Callable[[str], None] = sigterm_self,
        nodes: NodePlan | None = None,
        plan: dict[str, Any] | None = None,
        expert_parallel: bool = False,
        join_timeout_s: float = DEFAULT_JOIN_TIMEOUT_S,
    ) -> None:
        options = options or {}
        self.devices = list(devices)
        self.tensor_parallel = nodes.tensor_parallel if nodes is not None else len(devices)
        self.nodes = nodes
        self._loss = EngineLoss(on_lost, kill=self._kill_followers)
        self._weights: dict[str, torch.Tensor] = {}
        self._lock = threading.Lock()
        self._calls = 0
        host = nodes.master_host if nodes is not None else LOOPBACK
        self._store = store = host_rendezvous(LOAD_TIMEOUT_S, host, nodes.master_port if nodes is not None else 0)
        engine_port = free_port(host)  # sglang's own group meets there
        self._channel = LeaderChannel(bind=f"tcp://{host}:*" if nodes is not None else None)
        self._watch: LeaderWatch | None = None
        self._followers: FollowerProcesses | None = None
        try:
            self._watch = LeaderWatch(f"tcp://{host}:*" if nodes is not None else local_endpoint(self._channel.folder, "watch"), self._follower_ended)
            interface = interface_towards(host) if nodes is not None else None
            meeting = Meeting(
                world_size=self.tensor_parallel,
                nnodes=nodes.nnodes if nodes is not None else 1,
                store_host=host,
                store_port=store.port,
                engine_port=engine_port,
                channel=self._channel.endpoint,
                watch=self._watch.endpoint,
            )
            if nodes is not None:
                store.set(MEETING_KEY, meeting.model_dump_json())
                store.set(PLAN_KEY, json.dumps(plan or {}))
            built = TargetSpec(engine=engine, target=target, dtype=dtype, options=options, expert_parallel=expert_parallel)
            specs = [
                FollowerSpec(
                    target=built, meeting=meeting, rank=rank, local_rank=rank, device=self.devices[rank], interface=interface, parent_pid=os.getpid()
                )
                for rank in range(1, len(self.devices))
            ]
            self._followers = FollowerProcesses(specs, self._follower_ended)
            place = place_at(meeting, 0, self.devices[0], interface=interface, store=store)
            if nodes is not None:
                await_nodes(store, nodes, join_timeout_s, lambda: self.lost)
                log.info("worker: every node of %d joined at %s", nodes.nnodes, nodes.master)
            self.inner: Engine = build_ranked(engine, target, dtype, options, place, expert_parallel)
            self._channel.await_followers(self.tensor_parallel - 1, LOAD_TIMEOUT_S, lambda: self.lost or self._refused())
            if engine == "hf":
                self._check_padded_batch(target)
        except BaseException:
            self._abandon()
            raise
        self._loss.started = True
        self.name = self.inner.name
        self.shape = self.inner.shape
        self.device = self.inner.device
        self.dtype = self.inner.dtype
        self.logit_transform = self.inner.logit_transform
        self.model_features: bool = getattr(self.inner, "model_features", False)  # DSpark features the model defines (base.py)
        self.image_inputs: frozenset[str] = frozenset()
        self.images_refusal = PARALLEL_IMAGES_REFUSAL
        log.info("worker: the target runs over %d processes on %s", self.tensor_parallel, ", ".join(self.devices))

    def _refused(self) -> str | None:
        """What a node that refused to join said, or None (on one machine, always None)."""
        return refusal(self._store, self.nodes) if self.nodes is not None else None

    @property
    def pids(self) -> list[int]:
        """The worker's own process first, then its followers'."""
        return [os.getpid(), *(self._followers.pids if self._followers else [])]

    def _follower_ended(self, how: str) -> None:
        """Called on a watch thread when a follower ends while the worker runs."""
        self._loss.lose(how)

    def _kill_followers(self) -> None:
        if self._followers is not None:
            self._followers.kill()

    def _call(self, command: Prepare | Forward | Weight | Update, run: Callable[[], Any], tensors: dict[str, torch.Tensor] | None = None) -> Any:
        """Send a call to the followers, make it here, and take every follower's ack of it.

        The call's result when every rank made it; its exception when every rank raised one of the same type (the
        group is still in step: a batch the model cannot take fails here as it would on one device). Anything
        else leaves the ranks out of step: EngineLost, and the worker stops.
        """
        if self.lost is not None:
            raise EngineLost(f"the worker cannot compute: {self.lost}")
        with self._lock:
            command = command.model_copy(update={"call": self._calls})
            self._calls += 1
            self._channel.send(command, tensors)
            error: Exception | None = None
            try:
                result = run()
            except Exception as exc:
                error = exc
            acks = self._channel.await_acks(command.call, ACK_TIMEOUT_S if error is not None else COLLECTIVE_TIMEOUT_S, lambda: self.lost)
            outcomes = {None if error is None else type(error).__name__} | {ack.error_type for ack in acks or ()}
            if acks is not None and len(outcomes) == 1:
                if error is not None:
                    self._channel.send(GoOn(call=command.call))
                    raise error
                return result
            self._loss.out_of_step(f"its ranks ended call {command.call} ({command.type}) differently: {self._outcomes(error, acks)}")
            raise EngineLost(f"the worker cannot compute: {self.lost}") from error

    @staticmethod
    def _outcomes(error: Exception | None, acks: list[Ack] | None) -> str:
        here = "rank 0 " + ("returned" if error is None else f"raised {type(error).__name__}: {error}")
        if acks is None:
            return f"{here}; not every other rank answered"
        return "; ".join([here, *(f"rank {a.rank} " + ("returned" if a.error_type is None else f"raised {a.error_type}: {a.error}") for a in acks)])

    def prepare(self, captures: Sequence[Capture]) -> None:
        self._call(Prepare(call=0, captures=[spec_of(c) for c in captures]), lambda: self.inner.prepare(captures))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, capture: Capture, documents: Documents | None = None) -> ForwardOutput:
        tensors = {"input_ids": input_ids, "attention_mask": attention_mask}
        if documents is not None:
            tensors |= {"seq_lens": documents.seq_lens, "position_ids": documents.position_ids}
        command = Forward(call=0, capture=spec_of(capture), tensors=[])
        if documents is None:
            run = lambda: self.inner.forward(input_ids, attention_mask, capture)  # noqa: E731
        else:
            run = lambda: self.inner.forward(input_ids, attention_mask, capture, documents=documents)  # type: ignore[call-arg]  # noqa: E731
        return self._call(command, run, tensors)

    def _weight(self, which: Literal["input", "output"]) -> torch.Tensor:
        """The weight gathered once. A task may first ask for it inside its inference-mode compute (EAGLE-1/2 and
        ViSpec apply lm_head there); the followers gather outside inference mode, so rank 0 does too: a DTensor's
        gather fails under it ("Cannot set version_counter for inference tensor") and leaves the ranks out of step."""
        if which not in self._weights:
            method = self.inner.input_embeddings if which == "input" else self.inner.output_embeddings

            def gather() -> torch.Tensor:
                with torch.inference_mode(False):
                    return method()

            self._weights[which] = self._call(Weight(call=0, which=which), gather)
        return self._weights[which]

    def _check_padded_batch(self, target: str) -> None:
        """A padded two-row forward on every rank, at start: a model whose transformers tensor-parallel plan cannot
        take one (a DeepSeek-V3 with fewer key/value heads than query heads fails any padded batch, at one process as
        at several) is refused now, in one line, not at its first real batch. The hf engine alone: it needs no
        ``prepare`` first."""
        input_ids = torch.zeros(2, 8, dtype=torch.int64)
        attention_mask = torch.ones_like(input_ids)
        attention_mask[1, 5:] = 0
        try:
            self.forward(input_ids, attention_mask, Capture(layer_ids=(0,), logits=True))
        except EngineLost:
            raise
        except Exception as exc:
            raise ValueError(
                f"{target}: the target fails a padded batch at --tensor-parallel {self.tensor_parallel} ({type(exc).__name__}: {exc}); "
                "serve it with --device-map auto, or with --engine vllm"
            ) from None

    def update_weights(self, message: UpdateWeights, check_finite: bool, timeout_s: float = 60.0, keys: KeyPair | None = None) -> None:
        """Every rank loads the update and keeps its own shard, between two calls; refused alike on every rank (the
        same file, the same checks), or the ranks are out of step and the worker stops (EngineLost). The embeddings
        gathered before are gathered again."""
        if getattr(self.inner, "update_weights", None) is None:
            raise UpdateRefused(f"engine {self.inner.name} cannot load weights in place yet: restart the worker with --target-version")
        if message.source_key is not None:  # its other processes hold no keys to pull with
            raise UpdateRefused(
                "a tensor-parallel worker cannot pull an encrypted update yet: write the weights to a file the workers read "
                "and use draftfeed target update --weights"
            )
        command = Update(call=0, message=message, check_finite=check_finite, timeout_s=timeout_s)
        self._call(command, lambda: self.inner.update_weights(message, check_finite, timeout_s))
        self._weights.clear()

    def input_embeddings(self) -> torch.Tensor:
        return self._weight("input")

    def output_embeddings(self) -> torch.Tensor:
        return self._weight("output")

    def close(self) -> None:
        """Stop the followers (they leave the group), then this rank; a follower that does not exit is killed."""
        if self._followers is None:
            return
        self._loss.close()
        if self.lost is None:
            self._channel.send(Stop())
            self._followers.stop()
        else:
            self._followers.kill()
        self._followers = None
        self.inner.close()
        self._channel.close()
        if self._watch is not None:
            self._watch.close()
        if torch.distributed.is_initialized() and self.lost is None:
            torch.distributed.destroy_process_group()

    def _abandon(self) -> None:
        """A failed start: no follower is left running, nothing is left bound, and the process that tried lives on."""
        self._loss.close()
        if self._followers is not None:
            self._followers.kill()
            self._followers = None
        if self._watch is not None:
            self._watch.close()
        self._channel.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
