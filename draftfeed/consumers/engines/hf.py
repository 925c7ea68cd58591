"""The reference engine: the target under transformers, intermediate tensors caught by forward hooks."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import ExitStack
from typing import Any, get_args

import torch
from torch import nn

from draftfeed.consumers.engines.base import EMBEDDINGS, FINAL_HIDDEN, Capture, ForwardOutput, TargetShape
from draftfeed.consumers.engines.hooks import first_input_hook, store_hook
from draftfeed.consumers.engines.images import accepted_image_inputs, check_image_rows, forward_images, image_forward
from draftfeed.consumers.engines.joining import JoinedWriter
from draftfeed.consumers.engines.loading import load_target, text_decoder, text_forward, transformers_config
from draftfeed.consumers.engines.parallel.group import LOAD_TIMEOUT_S, join_process_group
from draftfeed.consumers.engines.parallel.spec import ProcessPlace
from draftfeed.consumers.engines.plan_fixes import distributed_config
from draftfeed.consumers.settings import Dtype
from draftfeed.consumers.weight_updates import load_update
from draftfeed.contract.images import PACKED_WITH_IMAGES
from draftfeed.contract.packing import Documents
from draftfeed.schemas.errors import BadRequest
from draftfeed.schemas.messages import LogitTransform, UpdateWeights
from draftfeed.security.keys import KeyPair

_UNCHECKED = object()
# How far a packed document may be from itself alone: the same math over rows of other lengths differs in the last
# bits (5e-7 on the tiny targets here); a target that lets documents see each other differs by tenths.
PACKING_TOLERANCE = 1e-4


def packing_leak(engine: HFEngine) -> float:
    """The largest difference between a document packed after another in one row (block-causal mask, its own positions)
    and the same document alone, over the last layer's output: 0 for a target that keeps documents apart, up to float
    noise."""
    first, second = 5, 7
    ids = (torch.arange(first + second, dtype=torch.int64) * 7919 + 11) % engine.shape.vocab_size
    packed_ids, mask = ids.unsqueeze(0), torch.ones(1, first + second, dtype=torch.int64)
    documents = Documents(seq_lens=torch.tensor([[first, second]]), position_ids=torch.cat([torch.arange(first), torch.arange(second)]).unsqueeze(0))
    last = (engine.shape.num_hidden_layers - 1,)
    capture = Capture(layer_ids=last)
    packed = engine._forward_packed(packed_ids, mask, capture, documents)
    alone = engine._forward(packed_ids[:, first:], mask[:, first:], capture)
    got, want = packed.layer_outputs[last[0]][:, first:], alone.layer_outputs[last[0]]
    return float((got.double() - want.double()).abs().max())


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """``auto`` is float32 on CPU and bfloat16 on accelerators, as the supervision contract says."""
    if dtype == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    choices = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype not in choices:
        raise ValueError(f"--dtype {dtype!r} is not supported; choose {', '.join(get_args(Dtype))}")
    return choices[dtype]


class HFEngine:
    """Loads a target once (a causal LM, or an image-text model's text decoder: loading.py), frozen and in eval mode,
    straight onto its devices.

    One device: the weights are loaded onto it (``device_map``), never first into host memory. ``parallel``: this
    process is one rank of a tensor-parallel worker, the model sharded by transformers' own tensor-parallel plan
    over the group. ``device_map="auto"``: the layers spread over ``devices`` in this one process (accelerate's
    big-model placement), for a model without a tensor-parallel plan.
    """

    name = "hf"

    def __init__(
        self,
        target: str,
        device: str = "cpu",
        dtype: str = "auto",
        parallel: ProcessPlace | None = None,
        device_map: str | None = None,
        devices: Sequence[str] = (),
        expert_parallel: bool = False,
    ) -> None:
        self.device = torch.device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        config = transformers_config(target)
        if parallel is not None:
            self.device = join_process_group(parallel, timeout_s=LOAD_TIMEOUT_S)
            # Expert parallel: the experts sharded over the group by the model's own plan (each rank its share of
            # whole experts), the rest by its tensor-parallel plan, as transformers lays them out, with draftfeed's
            # entries where transformers' plan cannot run (plan_fixes.py).
            placement: dict = {"distributed_config": distributed_config(config, parallel.world_size, expert_parallel)}
        elif device_map == "auto":
            placement = _spread_over(devices or [device])
        elif device_map is not None:
            raise ValueError(f"--device-map {device_map!r}: the hf engine takes auto (layers across --devices in one process)")
        else:
            placement = {"device_map": {"": self.device}}
        model = load_target(target, config=config, dtype=self.dtype, **placement)
        self.model = model.eval().requires_grad_(False)
        self._text_forward = text_forward(self.model)
        self.image_inputs, self.images_refusal = accepted_image_inputs(self.model)
        text_config = model.config.get_text_config()
        self.shape = TargetShape.from_text_config(text_config)
        self.logit_transform = LogitTransform.from_text_config(text_config)
        self._packing_refusal: object = _UNCHECKED  # packing_refusal(): found at the first packed batch
        decoder = text_decoder(self.model)
        self.layers: nn.ModuleList = decoder.layers
        self.final_norm: nn.Module | None = getattr(decoder, "norm", None)

    def prepare(self, captures: Sequence[Capture]) -> None:
        """Nothing to do: hooks are placed per forward, and every layer can be caught."""

    def close(self) -> None:
        """Nothing to release beyond what garbage collection frees."""

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        capture: Capture,
        documents: Documents | None = None,
        images: dict[str, torch.Tensor] | None = None,
    ) -> ForwardOutput:
        """One forward; a packed batch (``documents``) gets its block-causal mask and per-document position ids, or,
        on a FlashAttention target (which takes no 4D mask), one forward per row packed by its position ids alone. A
        batch with ``images`` (checked against ``image_inputs``) runs the whole image-text model's forward with them."""
        if images:
            if documents is not None:
                raise BadRequest(PACKED_WITH_IMAGES)
            check_image_rows(self.model.config, input_ids, images)
            return self._forward(
                input_ids, attention_mask, capture, runner=image_forward(self.model), **forward_images(images, self.device, self.dtype)
            )
        if documents is not None:
            if (refusal := self.packing_refusal()) is not None:
                raise BadRequest(refusal)
            return self._forward_packed(input_ids, attention_mask, capture, documents)
        return self._forward(input_ids, attention_mask, capture)

    def _forward_packed(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, capture: Capture, documents: Documents) -> ForwardOutput:
        """A packed batch under its block-causal mask with per-document position ids, or, on a FlashAttention target,
        row by row by its position ids alone."""
        if self.packs_by_position_ids:
            return self._forward_rows_by_position_ids(input_ids, attention_mask, capture, documents)
        mask = documents.additive_mask(attention_mask, self.dtype, self.device)
        return self._forward(input_ids, mask, capture, position_ids=documents.position_ids.to(self.device))

    def packing_refusal(self) -> str | None:
        """Why this target's packed rows would not keep their documents apart, or None; found once, at the first packed
        batch, by packing two documents in one row and comparing the second with itself alone (``packing_leak``).
        Linear attention (Qwen3-Next, Qwen3.5, GLM-5.3's linear layers), DeepSeek-V4's compressed attention and
        MiniMax-M3's run over the whole row whatever the mask says."""
        if self._packing_refusal is _UNCHECKED:
            leak = packing_leak(self)
            self._packing_refusal = (
                None
                if leak <= PACKING_TOLERANCE
                else (
                    f"packed rows (seq_lens): this target ({self.model.config.model_type}) does not keep packed documents apart "
                    f"(a document packed after another differs from itself alone by up to {leak:.3g}: some of its layers attend "
                    "over the whole row whatever the block mask says); send unpacked rows for it"
                )
            )
        return self._packing_refusal  # type: ignore[return-value]

    @property
    def packs_by_position_ids(self) -> bool:
        """Whether packed rows go by position ids alone: FlashAttention kernels take no 4D mask; transformers finds
        the documents from where the position ids restart, at batch size 1."""
        return str(getattr(self.model.config, "_attn_implementation", "")).startswith("flash") or self.force_position_id_packing

    # Tests set it to run the FlashAttention path's logic on targets that have no FlashAttention (SDPA packs the same way).
    force_position_id_packing = False

    def _forward_rows_by_position_ids(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, capture: Capture, documents: Documents
    ) -> ForwardOutput:
        """Row by row, without an attention mask: a padded position may only come after the real ones of its
        document, since nothing else keeps a real token from attending to it. Each row writes its joined parts into
        its own row of the batch's joined tensor."""
        rows = []
        joined = JoinedWriter(capture.joined, leading=tuple(input_ids.shape)) if capture.joined is not None else None
        for row in range(input_ids.shape[0]):
            for start, end in documents.spans(row):
                real = attention_mask[row, start:end].bool()
                if bool(real[int(real.sum()) :].any()):
                    raise BadRequest(
                        f"row {row}: padding inside a document (not at its end), which this FlashAttention target cannot mask; "
                        "pad only at the end of a row, or serve with an eager or SDPA attention"
                    )
            position_ids = documents.position_ids[row : row + 1].to(self.device)
            rows.append(self._forward(input_ids[row : row + 1], None, capture, position_ids=position_ids, joined=joined, at=(slice(row, row + 1),)))
        return ForwardOutput(
            layer_outputs={i: torch.cat([r.layer_outputs[i] for r in rows]) for i in capture.layer_ids},
            embeddings=torch.cat([r.embeddings for r in rows]) if capture.embeddings else None,  # type: ignore[misc]
            final_hidden=torch.cat([r.final_hidden for r in rows]) if capture.final_hidden else None,  # type: ignore[misc]
            logits=torch.cat([r.logits for r in rows]) if capture.logits else None,  # type: ignore[misc]
            joined=joined.tensor if joined is not None else None,
        )

    def _forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        capture: Capture,
        runner: Callable[..., Any] | None = None,
        joined: JoinedWriter | None = None,
        at: tuple = (),
        **extra: torch.Tensor,
    ) -> ForwardOutput:
        """One forward; ``joined``: the writer of the capture's joined parts (one of its own when None), written at
        the leading index ``at``."""
        out = ForwardOutput()
        if joined is None and capture.joined is not None:
            joined = JoinedWriter(capture.joined)
        with ExitStack() as hooks:
            for layer_id in capture.needed_layer_ids():
                store = store_hook(out, joined, layer_id, layer_id in capture.layer_ids, self.device, at)
                hooks.callback(self.layers[layer_id].register_forward_hook(store).remove)
            if capture.needs_embeddings():
                store = store_hook(out, joined, EMBEDDINGS, capture.embeddings, self.device, at)
                hooks.callback(self.layers[0].register_forward_pre_hook(first_input_hook(store), with_kwargs=True).remove)
            if capture.needs_final_hidden():
                if self.final_norm is None:
                    raise ValueError(f"{type(self.model).__name__} has no final norm module (decoder.norm) to capture")
                store = store_hook(out, joined, FINAL_HIDDEN, capture.final_hidden, self.device, at)
                hooks.callback(self.final_norm.register_forward_hook(store).remove)
            result = (runner or self._text_forward)(
                input_ids=input_ids.to(self.device),
                attention_mask=attention_mask.to(self.device) if attention_mask is not None else None,
                use_cache=False,
                **extra,
                # Without logits wanted, compute them for one position only (the lm_head over all is wasted work).
                logits_to_keep=0 if capture.logits else 1,
            )
        if capture.logits:
            out.logits = result.logits.to(self.device)
        if joined is not None:
            out.joined = joined.tensor
        return out

    def named_weights(self) -> dict[str, torch.Tensor]:
        """The target's tensors by their state-dict names (as ``save_pretrained`` writes them), sharing their storage:
        a weight update copies into them (consumers/weight_updates.py). Tied tensors share one storage; a tensor-parallel
        process holds DTensors."""
        return dict(self.model.state_dict())

    def update_weights(self, message: UpdateWeights, check_finite: bool, timeout_s: float = 60.0, keys: KeyPair | None = None) -> None:
        """Load the update in place, all or nothing (consumers/weight_updates.py): UpdateRefused, UpdateBroken."""
        load_update(self.named_weights(), message, check_finite, timeout_s, keys)

    def input_embeddings(self) -> torch.Tensor:
        return whole_weight(self.model.get_input_embeddings().weight)

    def output_embeddings(self) -> torch.Tensor:
        return whole_weight(self.model.get_output_embeddings().weight)


def whole_weight(weight: torch.Tensor) -> torch.Tensor:
    """A weight as one tensor on this process: a tensor-parallel shard (DTensor) is gathered from every rank, which
    must all call this together."""
    from torch.distributed.tensor import DTensor

    weight = weight.detach()
    return weight.full_tensor() if isinstance(weight, DTensor) else weight


def _spread_over(devices: Sequence[str]) -> dict:
    """``from_pretrained``'s placement for ``--device-map auto``: accelerate's, over the free memory of the accelerators
    in ``devices`` and none other (not the host); on CPU, the host."""
    indices = [torch.device(d).index for d in devices if torch.device(d).type != "cpu"]
    if not indices:
        return {"device_map": {"": "cpu"}}
    return {"device_map": "auto", "max_memory": {index: torch.cuda.mem_get_info(index)[0] for index in indices}}


def tensor_parallel_problem(target: str, expert_parallel: bool = False) -> str | None:
    """Why transformers cannot shard ``target`` by its tensor-parallel plan (it has none), or by its expert-parallel
    plan when ``expert_parallel`` (it has none: a dense model, or one transformers has no plan for), or None."""
    config = transformers_config(target)
    text = config.get_text_config()
    if not text.base_model_tp_plan:
        return (
            f"{config.model_type} has no tensor-parallel plan in transformers; serve it with --device-map auto (its layers spread over "
            "--devices in one process) or with --engine vllm or sglang"
        )
    if expert_parallel and not getattr(text, "base_model_ep_plan", None):
        return (
            f"--expert-parallel: {config.model_type} has no expert-parallel plan in transformers (a dense model, or one it has no plan for); "
            "leave --expert-parallel out (its experts are then split by the tensor-parallel plan), or serve it with --engine vllm or sglang"
        )
    return None


def quantization_problem(target: str, device: str) -> str | None:
    """Why the hf engine cannot run ``target``'s quantized weights on ``device`` (FP8 and the other formats
    transformers runs on accelerators only), or None."""
    quantization = getattr(transformers_config(target), "quantization_config", None)
    if not quantization or torch.device(device).type != "cpu":
        return None
    settings = quantization if isinstance(quantization, dict) else quantization.to_dict()
    shown = ", ".join(f"{key} {value}" for key, value in settings.items() if key in ("quant_method", "fmt", "weight_block_size", "bits"))
    return (
        f"--target {target} is a quantized checkpoint (its quantization_config: {shown or settings}); the hf engine runs it on "
        "GPUs only: serve it with --device cuda:N, with --engine vllm or sglang (their own quantization support), with --engine "
        "automodel where NeMo AutoModel implements it (its adapter dequantizes DeepSeek's block-FP8 as it loads, on a CPU too), "
        "or from a bfloat16 copy of the checkpoint"
    )
