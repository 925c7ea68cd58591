"""RemoteEagle3Target: the training rank's view of a frozen EAGLE-3 target served by draftfeed workers.

Method and parameter names follow NeMo AutoModel's remote target backend, so a trainer written
against it calls this class unchanged.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, TypeVar

import torch
from torch import nn

from draftfeed.consumers.validation import BadRequest, validate_vocab_mapping
from draftfeed.producers.connection import Connection
from draftfeed.producers.prefetch import prefetch
from draftfeed.schemas.errors import RemoteTargetTimeout
from draftfeed.schemas.frames import pack, pack_tensors
from draftfeed.schemas.messages import Eagle3TargetInfo, ModelInfoQuery, SetVocabMapping, StatusQuery, Submit
from draftfeed.schemas.supervision import BATCH_KEYS, Eagle3Supervision

log = logging.getLogger("draftfeed.producer")
T = TypeVar("T")


class RemoteEagle3Target:
    """EAGLE-3 supervision from the workers of one service, through the broker at ``broker``.

    ``prefetch_depth`` is the one knob: at most that many batches of this rank are queued or in flight
    anywhere in the pipeline (0 means one at a time, fetched only when asked for). It sets the
    rank's credit window and its sockets' high-water marks.
    """

    def __init__(
        self,
        broker: str,
        service: str,
        prefetch_depth: int = 2,
        *,
        request_timeout: float = 600.0,
        connect_timeout: float = 60.0,
        device: torch.device | str | None = None,
        data_endpoint: str | None = None,
        wait_log_interval: float = 5.0,
    ) -> None:
        if prefetch_depth < 0:
            raise ValueError(f"prefetch_depth must be 0 or more, got {prefetch_depth}")
        self.service = service
        self.prefetch_depth = prefetch_depth
        self.request_timeout = request_timeout
        self.device = torch.device(device) if device is not None else None
        self.wait_log_interval = wait_log_interval
        self._connection = Connection(
            broker, service, max(prefetch_depth, 1), data_endpoint=data_endpoint, connect_timeout_s=connect_timeout
        )
        self._info: Eagle3TargetInfo | None = None
        self._input_embeddings: nn.Embedding | None = None

    # ------------------------------------------------------------ setup
    def model_info(self) -> Eagle3TargetInfo:
        """num_hidden_layers, hidden_size, vocab_size and aux_layer_ids of the service's target (asked once)."""
        if self._info is None:
            future = self._connection.request(
                lambda rid, _token: pack(ModelInfoQuery(request_id=rid)), lambda reply, _: reply.info, uses_window=False
            )
            self._info = self._wait(future, "the model info (is a worker for this service running?)")
        return self._info

    def set_vocab_mapping(self, selected_token_ids: torch.Tensor, selected_token_mask: torch.Tensor) -> None:
        """Use a draft vocabulary: ``selected_token_ids`` int64 [Vd] (draft id -> target id), ``selected_token_mask`` bool [V]."""
        ids = selected_token_ids.detach().to("cpu", torch.int64).contiguous()
        mask = selected_token_mask.detach().to("cpu", torch.bool).contiguous()
        try:
            validate_vocab_mapping(ids, mask, self.model_info().vocab_size)
        except BadRequest as exc:
            raise ValueError(f"set_vocab_mapping: {exc}") from None
        digest = hashlib.blake2b(ids.numpy().tobytes() + mask.numpy().tobytes(), digest_size=16).hexdigest()
        tensors = {"selected_token_ids": ids, "selected_token_mask": mask}
        future = self._connection.request(
            lambda rid, _token: pack_tensors(SetVocabMapping, tensors, request_id=rid, digest=digest),
            lambda _reply, _tensors: None,
            uses_window=False,
            is_mapping=True,
        )
        self._wait(future, "the broker's acknowledgement of the vocab mapping")

    def get_input_embeddings(self) -> nn.Embedding:
        """The target's input embedding as a frozen ``nn.Embedding`` ([V, H] weight), fetched once."""
        if self._input_embeddings is None:
            future = self._submit("input_embeddings", {}, lambda _reply, tensors: tensors["weight"])
            weight = self._wait(future, "the input embeddings")
            if self.device is not None:
                weight = weight.to(self.device)
            self._input_embeddings = nn.Embedding.from_pretrained(weight, freeze=True)
        return self._input_embeddings

    # ------------------------------------------------------------ supervision
    def generate_batch_async(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, loss_mask: torch.Tensor
    ) -> Future:
        """Send one batch; the future yields its Eagle3Supervision. Blocks while the prefetch window is full."""
        tensors = {"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": loss_mask}
        for name, tensor in tensors.items():
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")

        def finish(_reply: Any, out: dict[str, torch.Tensor]) -> Eagle3Supervision:
            supervision = Eagle3Supervision(**{name: out[name] for name in Eagle3Supervision.WIRE_FIELDS}, attention_mask=attention_mask)
            return supervision.to(self.device, non_blocking=True) if self.device is not None else supervision

        return self._submit("eagle3", tensors, finish)

    def generate_batch(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, loss_mask: torch.Tensor) -> Eagle3Supervision:
        """Supervision of one batch, blocking."""
        return self._wait(self.generate_batch_async(input_ids, attention_mask, loss_mask), "supervision")

    def iterate(self, dataloader: Iterable[Mapping[str, Any]]) -> Iterator[tuple[Mapping[str, Any], Eagle3Supervision]]:
        """Yield ``(batch, supervision)`` in the dataloader's order, keeping ``prefetch_depth`` batches in flight.

        Each batch is a mapping with input_ids, attention_mask and loss_mask; it is yielded as it came,
        other keys included.
        """

        def submit(batch: Mapping[str, Any]) -> Future:
            missing = [key for key in BATCH_KEYS if key not in batch]
            if missing:
                raise KeyError(f"batch has no {', '.join(missing)}; iterate() needs {', '.join(BATCH_KEYS)} in every batch")
            return self.generate_batch_async(*(batch[key] for key in BATCH_KEYS))

        return prefetch(dataloader, submit, lambda future: self._wait(future, "supervision"), self.prefetch_depth)

    # ------------------------------------------------------------ plumbing
    def _submit(self, kind: str, tensors: dict[str, torch.Tensor], finish: Any) -> Future:
        return self._connection.request(
            lambda rid, token: pack_tensors(Submit, tensors, request_id=rid, kind=kind, token=token),
            finish,
            uses_window=True,
            timeout_s=self.request_timeout,
        )

    def _wait(self, future: Future, what: str) -> Any:
        """The future's result; says every few seconds what it waits for; raises after request_timeout."""
        deadline = time.monotonic() + self.request_timeout
        while True:
            remaining = deadline - time.monotonic()
            try:
                return future.result(timeout=max(0.0, min(remaining, self.wait_log_interval)))
            except FutureTimeout:
                if time.monotonic() >= deadline:
                    raise RemoteTargetTimeout(
                        f"no answer with {what} from service {self.service!r} within {self.request_timeout:.0f} s "
                        "(request_timeout): no worker of that service served it; check `draftfeed status`"
                    ) from None
                silent = self._connection.broker_silent_s()
                broker = f"broker silent for {silent:.0f} s" if silent > 2 * self.wait_log_interval else "broker reachable"
                log.warning(
                    "draftfeed: waiting %.0f s for %s from service %r (%d batches in flight, %s)",
                    self.request_timeout - remaining, what, self.service, self.in_flight, broker,
                )

    def status(self) -> dict[str, Any]:
        """The broker's status document (services, workers, ranks, queues)."""
        future = self._connection.request(
            lambda rid, _token: pack(StatusQuery(request_id=rid)), lambda reply, _: reply.status, uses_window=False, resend=False
        )
        return self._wait(future, "the broker status")

    @property
    def in_flight(self) -> int:
        """Batches of this rank sent and not yet answered."""
        return self._connection.in_flight

    @property
    def peak_in_flight(self) -> int:
        return self._connection.peak_in_flight

    @property
    def client_id(self) -> str:
        """This rank's name at the broker (as ``draftfeed status`` lists it)."""
        return self._connection.client_id

    @property
    def connection_stats(self):
        """Duplicate and foreign answers dropped, resyncs after broker restarts, busy retries."""
        return self._connection.stats

    def close(self) -> None:
        """Release the sockets and the IO thread; outstanding requests fail with TargetClosed."""
        self._connection.close()

    def __enter__(self) -> "RemoteEagle3Target":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
