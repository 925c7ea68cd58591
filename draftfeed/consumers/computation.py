"""What a dispatched request asks of the worker's task and engine: a batch's supervision, checked first (its
tensors, its rows' length, its image inputs, its vocab mapping) and after (finite: contract/finite.py), or the
target's embedding weights."""

from __future__ import annotations

from typing import Any

import torch

from draftfeed.consumers.engines.base import image_policy
from draftfeed.consumers.mappings import WorkerMappings
from draftfeed.consumers.tasks.base import Task
from draftfeed.consumers.validation import image_tensors, validate_batch
from draftfeed.contract.finite import NonFinite, first_nonfinite
from draftfeed.dataplane.frames.codec import decode_tensors
from draftfeed.schemas.errors import BadRequest
from draftfeed.schemas.messages import CLIENTS, TASKS, Dispatch


class NonFiniteResult(Exception):
    """The supervision computed for a request held NaN or Inf (``at`` says where): it is not sent."""

    def __init__(self, at: NonFinite) -> None:
        super().__init__(f"supervision is not finite: {at.describe()}")
        self.at = at


class Computation:
    """Computes the requests of one worker's service (``name`` and ``service`` as the worker's; rows longer than
    ``max_seq_len`` refused, None: no limit; supervision checked finite unless ``check_finite`` is False)."""

    def __init__(
        self,
        task: Task,
        mappings: WorkerMappings,
        name: str,
        service: str,
        max_request_bytes: int,
        max_seq_len: int | None,
        check_finite: bool = True,
    ) -> None:
        self.task = task
        self.check_finite = check_finite
        self.mappings = mappings
        self.name = name
        self.service = service
        self.max_request_bytes = max_request_bytes
        self.max_seq_len = max_seq_len

    def compute(self, dispatch: Dispatch, tensor_frames: list[Any]) -> dict[str, torch.Tensor]:
        """The tensors that answer ``dispatch``; BadRequest for a request that is not this worker's to serve."""
        request = dispatch.request
        if dispatch.service != self.service:
            raise BadRequest(f"worker {self.name} serves {self.service!r}, not {dispatch.service!r}")
        tensors = decode_tensors(request.tensors, tensor_frames, max_message_bytes=self.max_request_bytes)
        if request.kind == self.task.name:
            accepted, refusal = image_policy(self.task.engine)
            documents = validate_batch(tensors, self.task.shape.vocab_size, self.max_seq_len, accepted, refusal)
            vocab = self.mappings.get(request.mapping_digest)
            images = image_tensors(tensors) or None
            supervision = self.task.compute(tensors["input_ids"], tensors["attention_mask"], tensors["loss_mask"], vocab, documents, images=images)
            if self.check_finite and (at := first_nonfinite(supervision, self.task.layer_fields(), self.task.shape.hidden_size)) is not None:
                raise NonFiniteResult(at)
            return supervision
        if request.kind == "input_embeddings":
            return {"weight": self.task.engine.input_embeddings()}
        if request.kind == "output_embeddings":
            return {"weight": self.output_embedding_rows(tensors.get("rows"))}
        client = CLIENTS[request.kind] if request.kind in TASKS else "the client of that task"  # type: ignore[index]
        raise BadRequest(
            f"worker {self.name} serves {self.task.name} supervision, not {request.kind}: connect a {client} to a {request.kind} service"
        )

    def output_embedding_rows(self, rows: torch.Tensor | None) -> torch.Tensor:
        """The lm_head weight, or only the given rows (the draft vocab's, for the compact EAGLE-3 form)."""
        weight = self.task.engine.output_embeddings()
        if rows is None:
            return weight
        vocab = self.task.shape.vocab_size
        if rows.dtype != torch.int64 or rows.dim() != 1 or (rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= vocab)):
            raise BadRequest(f"rows must be a 1-D int64 tensor of ids in [0, {vocab})")
        return weight.index_select(0, rows.to(weight.device))
