"""NeMo AutoModel's P-EAGLE on draftfeed, its code unchanged: ``TrainEagle3Recipe`` with ``parallel_drafting: true``,
served by the ``dflash`` task with logits.

P-EAGLE's trainer takes the target's full-vocab logits, which NeMo's remote backend does not send, so nemo-automodel
0.7.0 refuses ``parallel_drafting`` on any backend but ``colocated`` before it builds the target. A config that names a
draftfeed service the way every other recipe does (``target_model_backend: remote``, ``remote_urls:
["draftfeed://HOST:PORT/SERVICE"]``) is served through the seams of ``recipes.py``:

1. the recipe's wrapped ``setup`` asks ``served_path`` whether the config is P-EAGLE on draftfeed (else the recipe is
   left to NeMo: EAGLE-3 keeps its remote backend, ``eagle3.py``); it checks the config (one ValueError), then runs the
   recipe's own ``setup`` with the recipe's draftfeed target in force and ``recipe_args.target_model_backend`` reading
   ``colocated`` (``remote`` again when it returns), so the recipe takes its colocated path;
2. that path's ``NeMoAutoModelForCausalLM.from_pretrained`` gives the stand-in target model (``standin.py``);
3. its ``HFEagle3TargetModel(...)`` gives a ``DraftfeedPeagleTarget``, whose ``generate_batch`` makes NeMo's
   ``Eagle3TargetBatch`` out of the service's supervision exactly as ``HFEagle3TargetModel`` makes it out of its own
   forward: the aux layers' outputs as they are, the logits, ``input_ids`` and ``loss_mask`` shifted left by one with a
   zero at the end, ``attention_mask`` as sent.

NeMo is imported by the wrapper's constructor, never by importing this module.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch

from draftfeed.integrations.nemo.eagle3 import UNCAPPED
from draftfeed.integrations.nemo.standin import DraftfeedTargetModel
from draftfeed.integrations.nemo.wrappers import DraftfeedWrapper
from draftfeed.integrations.url import SCHEME, is_draftfeed_url, listed_urls
from draftfeed.producers.outgoing import takes_arguments_of
from draftfeed.producers.tasks.dflash import RemoteDFlashTarget

TASK = "dflash"
BACKEND = "target_model_backend"
EAGLE3_TARGET = "nemo_automodel.components.speculative.eagle.target"
EAGLE3_BACKEND = "nemo_automodel.components.speculative.eagle.backend"


def asks_for_draftfeed(args: Any) -> bool:
    """Whether a ``TrainEagle3Recipe``'s ``recipe_args`` ask for P-EAGLE on draftfeed: ``parallel_drafting`` on, the
    ``remote`` backend and a draftfeed:// URL. Without ``parallel_drafting`` the recipe's remote backend serves
    EAGLE-3 (``eagle3.py``); with no draftfeed URL the config is NeMo's own."""
    if not args.get("parallel_drafting", False) or args.get(BACKEND, None) != "remote":
        return False
    return any(is_draftfeed_url(url) for url in listed_urls(args.get("remote_urls", None)))


def check_config(name: str, args: Any) -> None:
    """One ValueError for what draftfeed cannot serve as asked (the URL itself is checked by ``RecipeTarget.of``)."""
    others = [str(url) for url in listed_urls(args.get("remote_urls", None)) if not is_draftfeed_url(url)]
    if others:
        raise ValueError(
            f"{name} with parallel_drafting: recipe_args.remote_urls mixes draftfeed URLs with others ({', '.join(others)}): "
            f"give only {SCHEME}://HOST:PORT/SERVICE URLs (P-EAGLE has no remote backend in NeMo)"
        )
    partitions = int(args.get("sequence_partitions", 1) or 1)
    depth = int(args.get("target_prefetch_depth", 0) or 0)
    if partitions > 1 and depth > 0:
        raise ValueError(
            f"{name}: sequence_partitions={partitions} fetches each batch's supervision inside its step, so "
            f"target_prefetch_depth={depth} would have every batch computed twice: set target_prefetch_depth: 0"
        )


def worker_flags(layer_ids: Sequence[int]) -> str:
    """The worker flags of a service that serves a P-EAGLE recipe with these aux layers."""
    return f"--task {TASK} --capture-logits --target-layer-ids {','.join(str(i) for i in layer_ids)}"


class PendingPeagleBatch:
    """What ``generate_batch_async`` returns, as NeMo's async backends do: ``result()`` gives the ``Eagle3TargetBatch``
    (waiting at most ``request_timeout`` when no timeout is given); ``cancel()``, ``done()``."""

    def __init__(self, owner: DraftfeedPeagleTarget, future: Future) -> None:
        self._owner = owner
        self._future = future
        self._batch: Any = None

    def result(self, timeout: float | None = None) -> Any:
        if self._batch is None:
            supervision = self._owner.target.wait(self._future) if timeout is None else self._future.result(timeout)
            self._batch = self._owner._to_nemo(supervision)
        return self._batch

    def cancel(self) -> bool:
        return self._future.cancel()

    def done(self) -> bool:
        return self._future.done()


class DraftfeedPeagleTarget(DraftfeedWrapper):
    """NeMo's ``HFEagle3TargetModel`` for P-EAGLE on a ``dflash`` service that captures logits: ``generate_batch`` gives
    the ``Eagle3TargetBatch`` NeMo's wrapper gives (``aux_hidden_states`` [B, S, 3H], ``logits`` [B, S, V], both as the
    target computes them, the logits, ``input_ids`` and ``loss_mask`` shifted left with a zero tail). The service's
    ``--target-layer-ids`` must be the recipe's ``aux_layer_ids`` (NeMo's default ``[1, L // 2 - 1, L - 4]`` when
    unset). ``generate_batch_async`` lets the recipe's ``target_prefetch_depth`` overlap the workers with training."""

    TASK = TASK
    NEMO = "HFEagle3TargetModel"

    def __init__(self, model: DraftfeedTargetModel, aux_layer_ids: Sequence[int] | None = None, cp_mesh: Any = None) -> None:
        from draftfeed.schemas.messages import DFlashTargetInfo

        nemo = importlib.import_module(EAGLE3_TARGET)
        text = model.config.get_text_config() if callable(getattr(model.config, "get_text_config", None)) else model.config
        layers = int(text.num_hidden_layers)
        ids = list(aux_layer_ids) if aux_layer_ids is not None else nemo.default_eagle3_aux_layer_ids(layers)
        self.aux_layer_ids = nemo.validate_eagle3_aux_layer_ids(ids, layers)
        self.cp_mesh = cp_mesh  # the recipe's; P-EAGLE refuses context parallelism, and the workers run the whole sequence
        self._shift = nemo._shift_left_with_zero  # NeMo's own shift, so the batch is NeMo's bit for bit
        importlib.import_module(EAGLE3_BACKEND).Eagle3TargetBackend.register(DraftfeedPeagleTarget)
        expected = DFlashTargetInfo.from_text_config(model.config, self.aux_layer_ids, capture_logits=True)
        super().__init__(model, nemo.Eagle3TargetBatch, expected)

    def _remedy(self) -> str:
        return f"start its workers with {worker_flags(self.aux_layer_ids)}, or set recipe_args.aux_layer_ids to the service's"

    @property
    def supports_async(self) -> bool:
        return True

    @property
    def num_remote_servers(self) -> int:
        """Not a count of servers: the broker queues the batches for all the service's workers, so the recipe need not
        cap its ``target_prefetch_depth``; the URL's ``prefetch_depth`` bounds the batches in flight."""
        return UNCAPPED

    def set_vocab_mapping(self, selected_token_ids: torch.Tensor, selected_token_mask: torch.Tensor) -> None:
        """Nothing to do, as on NeMo's colocated wrapper: P-EAGLE's trainer maps the full-vocab logits itself."""

    @takes_arguments_of(RemoteDFlashTarget.generate_batch_async)
    def generate_batch(self, *args: Any, **kwargs: Any) -> Any:
        """The batch's ``Eagle3TargetBatch``, as ``HFEagle3TargetModel.generate_batch`` takes and returns it."""
        return self._to_nemo(self.target.generate_batch(*args, **kwargs))

    @takes_arguments_of(RemoteDFlashTarget.generate_batch_async)
    def generate_batch_async(self, *args: Any, **kwargs: Any) -> PendingPeagleBatch:
        """Send one batch; ``result()`` of what comes back is its ``Eagle3TargetBatch``. Blocks while the URL's
        ``prefetch_depth`` batches are in flight."""
        return PendingPeagleBatch(self, self.target.generate_batch_async(*args, **kwargs))

    def _to_nemo(self, supervision: Any) -> Any:
        return self._batch_type(
            aux_hidden_states=supervision.hidden_states,
            logits=self._shift(supervision.logits),
            input_ids=self._shift(supervision.input_ids),
            attention_mask=supervision.attention_mask,
            loss_mask=self._shift(supervision.loss_mask),
            position_ids=supervision.position_ids,
            seq_lens=supervision.seq_lens,
            doc_remaining=supervision.doc_remaining,
        )


def served_path(recipe: Any) -> AbstractContextManager[None] | None:
    """For recipes.py's setup wrapper: None where the recipe's config is NeMo's own (no P-EAGLE on draftfeed asked);
    else what the recipe's own setup runs within, ``recipe_args.target_model_backend`` reading ``colocated``, after
    one ValueError for what draftfeed cannot serve as asked."""
    args = recipe.cfg.recipe_args
    if not asks_for_draftfeed(args):
        return None
    check_config(type(recipe).__name__, args)
    return _seen_as_colocated(args)


@contextmanager
def _seen_as_colocated(args: Any) -> Iterator[None]:
    """``recipe_args.target_model_backend`` reads ``colocated`` inside, and what it held again after (ConfigNode keeps
    its keys as attributes)."""
    values = vars(args)
    held = values[BACKEND]
    values[BACKEND] = "colocated"
    try:
        yield
    finally:
        values[BACKEND] = held


__all__ = ["DraftfeedPeagleTarget", "PendingPeagleBatch", "asks_for_draftfeed", "check_config", "served_path", "worker_flags"]
