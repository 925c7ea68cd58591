"""NeMo AutoModel's EAGLE-3 recipe on draftfeed, unchanged: its ``remote`` target backend served by a broker.

``patch()`` makes the recipe's remote backend (``RemoteEagle3TargetModel.from_urls``) build a
``DraftfeedEagle3TargetModel`` for ``draftfeed://HOST:PORT/SERVICE`` URLs and leaves every other URL to NeMo's
own class. ``DraftfeedEagle3TargetModel`` has the methods and properties the recipe and NeMo's trainer call on
a target backend, delegated to ``draftfeed.RemoteEagle3Target``. NeMo is imported by ``patch()`` and by
the class's constructor, never by importing this module (docs/nemo.md).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

import torch

from draftfeed.integrations.url import SCHEME, is_draftfeed_url, listed_urls, one_url
from draftfeed.producers.outgoing import takes_arguments_of
from draftfeed.producers.settings import RankSettings
from draftfeed.producers.tasks.eagle3 import RemoteEagle3Target

log = logging.getLogger("draftfeed.nemo")
_DEFAULTS = RankSettings()

# What num_remote_servers reports: the recipe caps its prefetch depth at it, and no depth reaches it.
UNCAPPED = 1 << 30
_NEMO_MARK = "_draftfeed_dispatch"


class PendingSupervision:
    """What ``generate_batch_async`` returns, as NeMo's remote backend does: ``result()`` gives the batch's
    ``Eagle3TargetBatch`` (waiting at most ``request_timeout`` when no timeout is given); ``cancel()``, ``done()``."""

    def __init__(self, owner: DraftfeedEagle3TargetModel, future: Future) -> None:
        self._owner = owner
        self._future = future
        self._batch: Any = None
        self._counted = False  # counted off the owner's handles in flight

    def result(self, timeout: float | None = None) -> Any:
        if self._batch is None:
            owner = self._owner
            owner._check_depth()
            try:
                supervision = owner.target.wait(self._future) if timeout is None else self._future.result(timeout)
            finally:
                if self._future.done() and not self._counted:
                    self._counted = True
                    owner._collected()
            self._batch = owner._to_nemo(supervision)
        return self._batch

    def cancel(self) -> bool:
        return self._future.cancel()

    def done(self) -> bool:
        return self._future.done()


class DraftfeedEagle3TargetModel:
    """NeMo AutoModel's EAGLE-3 target backend, served by the draftfeed workers of one service.

    ``urls``: one ``draftfeed://HOST[:PORT]/SERVICE?OPTION=VALUE&...`` URL (a list of the same URL counts as one):
    the broker's frontend at ``tcp://HOST:PORT`` (PORT defaults to 5555) and the workers' ``--service``. Its options are
    RemoteEagle3Target's (``prefetch_depth``, ``data_plane``, ``keys``, ...); ``timeout`` is its ``request_timeout``
    and ``device`` where supervision lands. ``max_retries`` is accepted for the recipe's call and not used: a batch
    whose worker fails is computed again by another (docs/reliability.md).

    ``num_remote_servers`` is not a count of servers: the broker is one queue over all the service's workers, so the
    recipe need not cap its ``target_prefetch_depth``. The URL's ``prefetch_depth`` bounds the batches in flight.
    """

    def __init__(
        self,
        urls: Sequence[str] | str,
        *,
        device: torch.device | str | None = None,
        timeout: float = _DEFAULTS.request_timeout,
        max_retries: int | None = None,
    ) -> None:
        if max_retries is not None and (isinstance(max_retries, bool) or not isinstance(max_retries, int) or max_retries < 0):
            raise ValueError(
                f"{type(self).__name__}: max_retries={max_retries!r} must be a whole number >= 0 (it is not used: draftfeed re-sends by itself)"
            )
        self.url = one_url(urls, timeout=timeout, device=device)
        nemo = _nemo()
        nemo.backend.Eagle3TargetBackend.register(DraftfeedEagle3TargetModel)
        self._batch_type = nemo.target.Eagle3TargetBatch
        self._lock = threading.Lock()
        self._pending = 0  # handles given out whose result() was not yet taken
        self._peak = 0  # the most there were at once
        self._warned_depth = False
        self.target = RemoteEagle3Target(self.url.broker, self.url.service, **self.url.target_arguments())

    @classmethod
    def from_urls(cls, urls: Sequence[str] | str, device: torch.device | str | None = None, **kwargs: Any) -> DraftfeedEagle3TargetModel:
        """As the recipe calls NeMo's backend: ``from_urls(remote_urls, device=..., timeout=..., max_retries=...)``."""
        return cls(urls, device=device, **kwargs)

    # ------------------------------------------------------------ what the recipe reads
    @property
    def supports_async(self) -> bool:
        return True

    @property
    def num_remote_servers(self) -> int:
        return UNCAPPED

    @property
    def aux_layer_ids(self) -> list[int]:
        return list(self.target.model_info().aux_layer_ids)

    def model_info(self) -> dict[str, Any]:
        """num_hidden_layers, hidden_size, vocab_size and aux_layer_ids of the service's target, as a dict."""
        return self.target.model_info().model_dump(exclude={"task"})

    def get_input_embeddings(self) -> torch.nn.Embedding:
        """The target's input embedding (``.weight`` [V, H] on ``device``), fetched once."""
        return self.target.get_input_embeddings()

    def set_vocab_mapping(self, selected_token_ids: torch.Tensor, selected_token_mask: torch.Tensor) -> None:
        self.target.set_vocab_mapping(selected_token_ids, selected_token_mask)

    # ------------------------------------------------------------ supervision
    @takes_arguments_of(RemoteEagle3Target.generate_batch_async)
    def generate_batch(self, *args: Any, **kwargs: Any) -> Any:
        """The batch's supervision as NeMo's ``Eagle3TargetBatch`` (``target_probs`` and ``position_mask``, no logits);
        a packed batch (``seq_lens``) keeps attention within each document and carries its packing fields back."""
        return self._to_nemo(self.target.generate_batch(*args, **kwargs))

    @takes_arguments_of(RemoteEagle3Target.generate_batch_async)
    def generate_batch_async(self, *args: Any, **kwargs: Any) -> PendingSupervision:
        """Send one batch; ``result()`` of what comes back is its ``Eagle3TargetBatch``. Blocks while ``prefetch_depth``
        batches are in flight (the URL's option)."""
        with self._lock:
            self._pending += 1
            self._peak = max(self._peak, self._pending)
        try:
            future = self.target.generate_batch_async(*args, **kwargs)
        except BaseException:
            self._collected()
            raise
        return PendingSupervision(self, future)

    def _collected(self) -> None:
        with self._lock:
            self._pending -= 1

    def _check_depth(self) -> None:
        """Once: say so when the trainer kept more handles outstanding than the URL's prefetch_depth lets fly (the
        batches past it waited in generate_batch_async). Checked at a result(), when a prefetch loop has filled up."""
        window = max(self.target.prefetch_depth, 1)
        with self._lock:
            peak, warn = self._peak, self._peak > window and not self._warned_depth
            self._warned_depth |= warn
        if warn:
            log.warning(
                "draftfeed: the trainer keeps %d batches in flight but the draftfeed URL's prefetch_depth is %d, so each "
                "batch past it waited in generate_batch_async for an answer: add prefetch_depth=%d to the URL %s",
                peak,
                window,
                peak,
                self.url.text,
            )

    def _to_nemo(self, supervision: Any) -> Any:
        fields = supervision.as_dict()
        fields["position_mask"] = fields["position_mask"].bool()
        return self._batch_type(**fields)

    def close(self) -> None:
        self.target.close()

    def __enter__(self) -> DraftfeedEagle3TargetModel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(broker={self.url.broker!r}, service={self.url.service!r}, prefetch_depth={self.target.prefetch_depth})"


class _Nemo:
    """The NeMo modules this adapter uses, imported on first use."""

    def __init__(self) -> None:
        try:
            from nemo_automodel.components.speculative.eagle import backend, target
            from nemo_automodel.components.speculative.eagle.remote import client
        except ImportError as exc:
            raise ImportError(f"draftfeed.integrations.nemo needs NeMo AutoModel (pip install nemo-automodel): {exc}") from exc
        self.backend, self.target, self.client = backend, target, client


_NEMO: _Nemo | None = None


def _nemo() -> _Nemo:
    global _NEMO
    if _NEMO is None:
        _NEMO = _Nemo()
    return _NEMO


def patch() -> None:
    """Make NeMo AutoModel's remote EAGLE-3 backend take draftfeed URLs.

    After this call ``RemoteEagle3TargetModel.from_urls`` (what the ``train_eagle3`` recipe calls for
    ``target_model_backend: remote``) returns a ``DraftfeedEagle3TargetModel`` when its URLs are ``draftfeed://`` URLs,
    and NeMo's own backend for any other URL. Call it once before the recipe builds its target; calling it again
    changes nothing."""
    nemo = _nemo()
    nemo.backend.Eagle3TargetBackend.register(DraftfeedEagle3TargetModel)
    remote = nemo.client.RemoteEagle3TargetModel
    current = remote.__dict__["from_urls"]
    if getattr(current, _NEMO_MARK, False):
        return
    nemo_from_urls = current.__func__

    def from_urls(cls: type, urls: Sequence[str], *args: Any, **kwargs: Any) -> Any:
        """draftfeed:// URLs: a DraftfeedEagle3TargetModel (draftfeed.integrations.nemo.use_draftfeed); others: NeMo's own backend."""
        listed = listed_urls(urls)
        ours = [url for url in listed if is_draftfeed_url(url)]
        if not ours:
            return nemo_from_urls(cls, urls, *args, **kwargs)
        if len(ours) != len(listed):
            others = ", ".join(str(url) for url in listed if not is_draftfeed_url(url))
            raise ValueError(f"remote_urls mixes draftfeed URLs with others ({others}): give only {SCHEME}:// URLs, or none")
        return DraftfeedEagle3TargetModel.from_urls(listed, *args, **kwargs)

    dispatch = classmethod(from_urls)
    setattr(dispatch, _NEMO_MARK, True)
    remote.from_urls = dispatch


__all__ = ["DraftfeedEagle3TargetModel", "PendingSupervision", "patch"]
