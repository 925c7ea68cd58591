"""EAGLE-3 supervision from one forward pass, exactly as docs/contract.md defines it."""

from __future__ import annotations

import logging

import torch

from draftfeed.consumers.engines.base import Capture, Engine, Joined
from draftfeed.consumers.tasks.base import Task, TaskBatch, chosen_layer_ids
from draftfeed.consumers.tasks.chunked_head import argmax_in_chunks, probs_in_chunks
from draftfeed.contract.ops import lm_head_logits, shift_left
from draftfeed.contract.vocab import VocabMap
from draftfeed.schemas.messages import DEFAULT_SUPERVISION, Eagle3TargetInfo, LogitTransform, SupervisionForm

log = logging.getLogger("draftfeed.worker")


def default_aux_layer_ids(num_hidden_layers: int) -> list[int]:
    """The EAGLE-3 recipe: [1, L // 2 - 1, L - 4]."""
    return [1, num_hidden_layers // 2 - 1, num_hidden_layers - 4]


def check_aux_layer_ids(aux_layer_ids: list[int], num_hidden_layers: int, *, default: bool) -> list[int]:
    """Exactly 3 distinct ids in [0, L - 1]; never silently deduplicated."""
    where = f"the default aux layer ids {aux_layer_ids} (recipe [1, L//2-1, L-4])" if default else f"--aux-layer-ids {aux_layer_ids}"
    advice = f"pass --aux-layer-ids with 3 distinct ids in [0, {num_hidden_layers - 1}]"
    if len(aux_layer_ids) != 3:
        raise ValueError(f"{where}: EAGLE-3 needs exactly 3 aux layers; {advice}")
    if len(set(aux_layer_ids)) != 3:
        raise ValueError(f"{where} repeat a layer for a {num_hidden_layers}-layer target; {advice}")
    for layer_id in aux_layer_ids:
        if not 0 <= layer_id < num_hidden_layers:
            raise ValueError(f"{where}: layer {layer_id} does not exist in a {num_hidden_layers}-layer target; {advice}")
    return list(aux_layer_ids)


@torch.inference_mode()
def verified_logit_transform(engine: Engine) -> LogitTransform:
    """The transform that turns lm_head(final hidden) into this target's logits, checked on a probe batch.

    Configs do not always say what the model does (a multimodal class may skip the soft-capping its text
    config names), so the candidates are tried against a real forward; the compact form is refused for a
    target whose logits none of them reproduces.
    """
    vocab = engine.shape.vocab_size
    probe = (torch.arange(16) * 7919 % vocab).unsqueeze(0)
    out = engine.forward(probe, torch.ones_like(probe), Capture(final_hidden=True, logits=True))
    assert out.final_hidden is not None and out.logits is not None
    weight = engine.output_embeddings()
    candidates = [engine.logit_transform, LogitTransform()]
    for candidate in candidates:
        if torch.equal(lm_head_logits(out.final_hidden, weight, candidate), out.logits):
            return candidate
    for candidate in candidates:  # other kernels for the same math (fused lm_head on some engines)
        if torch.allclose(lm_head_logits(out.final_hidden, weight, candidate), out.logits, rtol=1e-3, atol=1e-3):
            return candidate
    raise ValueError(
        "--supervision hidden: this target's logits are not its lm_head applied to its final hidden state with a "
        "known scaling or soft-capping, so ranks could not rebuild them; use --supervision probs"
    )


def eagle3_from_forward(
    aux_hidden_states: torch.Tensor,
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    vocab: VocabMap,
) -> dict[str, torch.Tensor]:
    """The contract's tensors from the aux layer outputs (side by side, in order) and the full-vocab logits [B, S, V]."""
    shifted_logits = shift_left(logits)
    shifted_loss_mask = shift_left(loss_mask)
    target_probs = torch.softmax(shifted_logits.index_select(-1, vocab.selected_token_ids).float(), dim=-1)
    position_mask = (vocab.selected_token_mask[shifted_logits.argmax(-1)] & shifted_loss_mask.bool()).unsqueeze(-1)
    return {
        "aux_hidden_states": aux_hidden_states,
        "target_probs": target_probs,
        "position_mask": position_mask,
        "input_ids": shift_left(input_ids),
        "loss_mask": shifted_loss_mask,
    }


class Eagle3Task(Task):
    """EAGLE-3 supervision on top of any engine, sent in one of three forms (see SupervisionForm).

    A batch of more than ``chunk_tokens`` positions (0: never) takes its logits from the final norm's output a
    chunk at a time (chunked_head.py) instead of the engine's full-vocab logits, so its memory is bounded by the
    chunk; a batch that fits one chunk is computed as before, bit for bit. An engine that cannot give the final
    norm's output (said at start), or a target whose logits are not lm_head's (found at the first long batch), computes
    every batch whole.
    """

    name = "eagle3"
    INFO = Eagle3TargetInfo

    def __init__(
        self, engine: Engine, aux_layer_ids: list[int] | None = None, supervision: SupervisionForm = DEFAULT_SUPERVISION, chunk_tokens: int = 0
    ) -> None:
        super().__init__(engine)
        self.supervision = supervision
        layers = engine.shape.num_hidden_layers
        self.aux_layer_ids = chosen_layer_ids(aux_layer_ids, layers, lambda: default_aux_layer_ids(layers), check_aux_layer_ids)
        self._identity: VocabMap | None = None
        aux = Joined(tuple(self.aux_layer_ids))
        self.capture = Capture(joined=aux, logits=True, final_hidden=supervision == "hidden")
        self._chunk_capture = Capture(joined=aux, final_hidden=True)
        self.chunk_tokens = chunk_tokens
        if chunk_tokens:
            try:
                engine.prepare([self.capture, self._chunk_capture, Capture(final_hidden=True, logits=True)])
            except ValueError as exc:
                log.warning(
                    "worker: --chunk-tokens off: engine %s cannot give the final norm's output (%s); every batch is computed whole", engine.name, exc
                )
                self.chunk_tokens = 0
        if not self.chunk_tokens:
            engine.prepare([self.capture])
        self.logit_transform = verified_logit_transform(engine) if supervision == "hidden" else engine.logit_transform
        # The transform chunks are computed with: the verified one; checked at the first batch that needs chunks (a
        # probe forward at start would cost every worker a forward that most never need).
        self._chunk_transform: LogitTransform | None = self.logit_transform if supervision == "hidden" else None

    def info_fields(self) -> dict[str, object]:
        return {"aux_layer_ids": self.aux_layer_ids}

    def layer_fields(self) -> dict[str, list[int]]:
        return {"aux_hidden_states": list(self.aux_layer_ids)}

    def identity_vocab(self) -> VocabMap:
        if self._identity is None:
            self._identity = VocabMap.identity(self.shape.vocab_size, self.engine.device)
        return self._identity

    def supervise(self, batch: TaskBatch) -> dict[str, torch.Tensor]:
        """The contract's tensors of the batch, in the service's form; a long batch computes its logits in chunks."""
        if self.chunk_tokens and batch.input_ids.numel() > self.chunk_tokens and self._chunks_possible():
            return self._supervise_in_chunks(batch)
        out = self.forward(batch)
        assert out.logits is not None and out.joined is not None
        device = out.logits.device
        aux = out.joined
        input_ids, loss_mask = batch.input_ids.to(device), batch.loss_mask.to(device)
        if self.supervision == "hidden":
            assert out.final_hidden is not None
            return {
                "aux_hidden_states": aux,
                "final_hidden_states": out.final_hidden,  # post-norm, not shifted
                "target_argmax": out.logits.argmax(-1),  # over the full vocab, not shifted
                "input_ids": shift_left(input_ids),
                "loss_mask": shift_left(loss_mask),
            }
        result = eagle3_from_forward(aux, out.logits, input_ids, loss_mask, batch.vocab or self.identity_vocab())
        if self.supervision == "probs-bf16":
            result["target_probs"] = result["target_probs"].to(torch.bfloat16)
        return result

    def _chunks_possible(self) -> bool:
        """Whether lm_head on the final norm's output gives this target's logits (checked once, on a probe batch);
        if not, chunking is turned off and every batch is computed whole, as the worker then says."""
        if self._chunk_transform is None:
            try:
                self._chunk_transform = verified_logit_transform(self.engine)
            except ValueError:
                log.warning(
                    "worker: --chunk-tokens off: this target's logits are not lm_head's on its final hidden state; every batch is computed whole"
                )
                self.chunk_tokens = 0
                return False
        return True

    def _supervise_in_chunks(self, batch: TaskBatch) -> dict[str, torch.Tensor]:
        out = self.forward(batch, self._chunk_capture)
        final, aux = out.final_hidden, out.joined
        assert final is not None and aux is not None
        device = final.device
        weight, transform = self.engine.output_embeddings(), self._chunk_transform
        assert transform is not None  # _chunks_possible() set it
        input_ids, loss_mask = batch.input_ids.to(device), batch.loss_mask.to(device)
        if self.supervision == "hidden":
            return {
                "aux_hidden_states": aux,
                "final_hidden_states": final,
                "target_argmax": argmax_in_chunks(final, weight, transform, self.chunk_tokens),
                "input_ids": shift_left(input_ids),
                "loss_mask": shift_left(loss_mask),
            }
        probs, position_mask = probs_in_chunks(final, weight, transform, batch.vocab or self.identity_vocab(), loss_mask, self.chunk_tokens)
        return {
            "aux_hidden_states": aux,
            "target_probs": probs.to(torch.bfloat16) if self.supervision == "probs-bf16" else probs,
            "position_mask": position_mask,
            "input_ids": shift_left(input_ids),
            "loss_mask": shift_left(loss_mask),
        }
