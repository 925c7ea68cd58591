"""The automodel engine: the target under NeMo AutoModel's own implementation of its architecture (not
transformers'), intermediate tensors caught by forward hooks where NeMo's own target wrappers catch them.

It serves what only NeMo implements (DeepSeek-V4.1, ``deepseek_v41``) and gives a NeMo user the numbers NeMo's own
colocated target gives, for any architecture NeMo has a model class of its own for. The model is NeMo's class for the
checkpoint's architecture (NeMo's model registry), built with a ``BackendConfig``: on CPU every choice that has a torch
path (``CPU_BACKEND``), on an accelerator NeMo's own defaults; ``--engine-option`` sets any field of it. The weights are
read under the released checkpoint's names and mapped by the model's own ``state_dict_adapter``.

A model that defines its DSpark features itself (NeMo's ``get_dspark_target_feature_modules``: DeepSeek-V4.1 takes the
streams entering layer i's attention, after its Engram update) gives DSpark those (``model_features``), as NeMo's
``HFDSparkTargetModel`` does; otherwise the layer semantics are the hf engine's (base.py).

At ``--tensor-parallel N`` (``parallel``: this process's place among the worker's N, on one machine or over
``--nnodes``) the model is sharded as NeMo's own recipes shard their targets: FSDP over the N processes, and with
``--expert-parallel`` its experts over them too (automodel_sharding.py). A packed row's documents run as rows of their
own. Images are refused.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from torch import nn

from draftfeed.consumers.engines.automodel_sharding import (
    checkpoint_files,
    copy_into,
    load_sharded,
    map_group,
    mesh_context,
    mismatch,
    release_gathered,
    settle,
    sharded_model,
)
from draftfeed.consumers.engines.base import EMBEDDINGS, FINAL_HIDDEN, Capture, ForwardOutput, ModelFeature, TargetShape
from draftfeed.consumers.engines.hf import resolve_dtype, whole_weight
from draftfeed.consumers.engines.hooks import first_input_hook, store_hook
from draftfeed.consumers.engines.joining import JoinedWriter
from draftfeed.consumers.engines.packages import EnginePackage, import_engine_package
from draftfeed.consumers.engines.parallel.group import LOAD_TIMEOUT_S, join_process_group
from draftfeed.consumers.engines.parallel.spec import ProcessPlace
from draftfeed.consumers.engines.whole_layer_updates import checked_files, checkpoint_tensors, pulled
from draftfeed.contract.packing import Documents
from draftfeed.dataplane.frames.codec import DTYPES
from draftfeed.dataplane.weights.worker import UpdateRefused
from draftfeed.schemas.messages import LogitTransform, UpdateWeights
from draftfeed.security.keys import KeyPair

AUTOMODEL = EnginePackage(module="nemo_automodel", distributions="nemo-automodel (pip install 'draftfeed[automodel]')", minimum=(0, 7), below=(0, 8))

# NeMo's BackendConfig choices that run on a CPU: torch attention, linear layers, norms, experts and dispatch.
CPU_BACKEND: dict[str, Any] = {
    "attn": "sdpa",
    "linear": "torch",
    "rms_norm": "torch_fp32",
    "rope_fusion": False,
    "experts": "torch",
    "dispatcher": "torch",
    "gate_precision": "float32",
    "enable_hf_state_dict_adapter": True,
}
# What NeMo 0.7.0 runs on CUDA only, and what runs the same part on a CPU.
CUDA_ONLY_BACKEND = {
    ("attn", "te"): "attn=sdpa",
    ("attn", "flex"): "attn=sdpa",
    ("attn", "tilelang"): "attn=sdpa",
    ("linear", "te"): "linear=torch",
    ("rms_norm", "te"): "rms_norm=torch_fp32",
    ("experts", "te"): "experts=torch",
    ("experts", "gmm"): "experts=torch",
    ("experts", "torch_mm"): "experts=torch",
    ("dispatcher", "deepep"): "dispatcher=torch",
    ("dispatcher", "hybridep"): "dispatcher=torch",
}
IMAGES_REFUSAL = "engine automodel takes no image inputs in draftfeed yet: serve image-text batches with --engine hf"
# Model types whose NeMo 0.7.0 code has no torch path at all, by model type (the checkpoint's or its text model's), with
# what it runs on instead. Kimi-K3's linear attention takes fla's ShortConvolution (backend triton or cuda), its
# chunked and recurrent KDA kernels and its gated norm, all Triton or CUDA; transformers has no implementation of it.
KDA = (
    "Kimi-K3's linear attention (KDA) runs in NeMo AutoModel 0.7.0 on the fla package's Triton and CUDA kernels only "
    "(short convolution, chunked KDA, gated norm), and no other engine implements it"
)
KERNELS_ONLY = {"kimi_k3": KDA, "kimi_linear": KDA}


def backend_config(options: dict[str, Any]) -> Any:
    from nemo_automodel.components.models.common import BackendConfig

    return BackendConfig(**options)


def cpu_backend_problem(options: dict[str, Any]) -> str | None:
    """Why a backend choice cannot run on a CPU, naming the choice that does, or None."""
    for key, value in options.items():
        instead = CUDA_ONLY_BACKEND.get((key, value))
        if instead is not None:
            return f"--engine-option {key}={value} runs on CUDA only in NeMo AutoModel; on a CPU use --engine-option {instead} (or leave it out)"
    return None


def nemo_config(target: str) -> Any:
    """The target's config, read with NeMo's own config class for its model type where NeMo has one, else
    transformers' (NeMo's models of transformers' model types take transformers' configs)."""
    from nemo_automodel._transformers.registry import resolve_custom_config_cls
    from transformers import AutoConfig

    config_file = Path(target) / "config.json"
    if not config_file.is_file():
        raise ValueError(f"--target {target}: no config.json there; give a checkpoint folder")
    model_type = json.loads(config_file.read_text()).get("model_type")
    config_class = resolve_custom_config_cls(model_type) if model_type else None
    try:
        return config_class.from_pretrained(target) if config_class is not None else AutoConfig.from_pretrained(target)
    except Exception as exc:  # NeMo's config class rejects what transformers wrote (Qwen3-Next's layer types, say)
        raise ValueError(
            f"--target {target}: NeMo AutoModel cannot read its config ({_first_line(exc)}); serve this target with --engine hf"
        ) from None


def kernels_problem(config: Any, device: torch.device) -> str | None:
    """Why NeMo's model of ``config`` cannot run on ``device`` (KERNELS_ONLY), naming what it needs, or None."""
    why = KERNELS_ONLY.get(config.model_type) or KERNELS_ONLY.get(getattr(_text_config(config), "model_type", ""))
    if why is None:
        return None
    if device.type != "cuda":
        return f"{why}: serve it on GPUs (--device cuda) with fla installed (pip install flash-linear-attention); nothing runs it on a {device.type}"
    if importlib.util.find_spec("fla") is None:
        return f"{why}, and fla is not installed here: pip install flash-linear-attention"
    return None


def nemo_model_class(config: Any) -> type[nn.Module]:
    """NeMo's own model class for the config's architecture, or a one-line refusal."""
    from nemo_automodel._transformers.registry import get_registry

    architectures = list(getattr(config, "architectures", None) or [])
    for architecture in architectures:
        model_class = get_registry().resolve_custom_model_cls(architecture, config)
        if model_class is not None:
            return model_class
    raise ValueError(
        f"NeMo AutoModel has no model implementation of its own for {', '.join(architectures) or config.model_type}; "
        "serve this target with --engine hf (transformers' implementation), vllm or sglang"
    )


def build_model(model_class: type[nn.Module], config: Any, options: dict[str, Any], device: torch.device) -> nn.Module:
    """NeMo's model built on ``device``, or a one-line refusal naming why (model code that asks for a GPU on a CPU,
    an attention it does not take)."""
    try:
        with torch.device(device):
            return model_class(config, backend=backend_config(options))
    except Exception as exc:  # NeMo's own code refusing this machine or these options
        why = _first_line(exc)
        if device.type == "cpu" and "CUDA" in why:
            why = f"its code asks for a GPU while it is built ({why}), on a CPU"
        raise ValueError(f"NeMo AutoModel's {model_class.__name__} cannot be built here: {why}; serve this target with --engine hf") from None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


def read_weights(target: str) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint's safetensors files, under its own names."""
    from safetensors.torch import load_file

    return {name: tensor for file in checkpoint_files(target) for name, tensor in load_file(str(file)).items()}


def _text_config(config: Any) -> Any:
    text = getattr(config, "text_config", None)
    return text if text is not None else config.get_text_config()


class AutoModelEngine:
    """Loads the target once with NeMo's model class for it, frozen and in eval mode, on one device, or as rank
    ``parallel.rank`` of the worker's processes, sharded by NeMo (``expert_parallel``: its experts too)."""

    name = "automodel"
    image_inputs: frozenset[str] = frozenset()
    images_refusal = IMAGES_REFUSAL

    def __init__(
        self,
        target: str,
        device: str = "cpu",
        dtype: str = "auto",
        parallel: ProcessPlace | None = None,
        expert_parallel: bool = False,
        **backend: Any,
    ) -> None:
        import_engine_package(AUTOMODEL)
        self.device = torch.device(device)
        if parallel is not None:
            self.device = join_process_group(parallel, timeout_s=LOAD_TIMEOUT_S)
        self.dtype = resolve_dtype(dtype, self.device)
        options = (CPU_BACKEND if self.device.type == "cpu" else {"enable_hf_state_dict_adapter": True}) | backend
        if self.device.type == "cpu" and (problem := cpu_backend_problem(options)) is not None:
            raise ValueError(problem)
        config = nemo_config(target)
        if (problem := kernels_problem(config, self.device)) is not None:
            raise ValueError(f"--target {target}: {problem}")
        model_class = nemo_model_class(config)
        self._moe_mesh = None  # the expert mesh the adapter maps for (sharded only)
        if parallel is None:
            model = build_model(model_class, config, options, self.device)
            weights = read_weights(target)
            adapter = getattr(model, "state_dict_adapter", None)  # a model whose names are the checkpoint's has none
            missing, unexpected = model.load_state_dict(adapter.from_hf(weights) if adapter is not None else weights, strict=False)
            if missing or unexpected:
                raise ValueError(
                    f"--target {target}: its weights do not fit NeMo's {model_class.__name__}: "
                    f"{len(missing)} missing (first {missing[:3]}), {len(unexpected)} unexpected (first {unexpected[:3]})"
                )
            model = model.to(self.dtype)
        else:
            try:
                mesh = mesh_context(parallel.world_size, expert_parallel, self.dtype)
                model = sharded_model(lambda: build_model(model_class, config, options, self.device), mesh, self.device, self.dtype)
            except (AssertionError, RuntimeError, TypeError) as exc:  # NeMo's parallelizer refusing this layout
                how = f"over {parallel.world_size} processes" + (" with --expert-parallel" if expert_parallel else "")
                raise ValueError(
                    f"NeMo AutoModel cannot shard its {model_class.__name__} {how}: {_first_line(exc)}; give a --tensor-parallel "
                    "that it can shard (one that divides its experts for --expert-parallel), or leave --expert-parallel out"
                ) from None
            self._moe_mesh = mesh.moe_mesh if expert_parallel else None
            load_sharded(model, target, self._moe_mesh)
            settle(model, self.device)
            adapter = getattr(model, "state_dict_adapter", None)
        self.model = model.eval().requires_grad_(False)
        self.target, self._adapter = target, adapter
        self._checkpoint: dict[str, torch.Tensor] | None = None  # its names, shapes and dtypes, for updates
        text_config = _text_config(config)
        self.shape = TargetShape.from_text_config(text_config)
        self.logit_transform = LogitTransform.from_text_config(text_config)
        inner = model.model
        self.layers: list[nn.Module] = (
            [inner.layers[str(i)] for i in range(len(inner.layers))] if isinstance(inner.layers, nn.ModuleDict) else list(inner.layers)
        )
        self.final_norm: nn.Module = inner.norm
        self._accepts = set(inspect.signature(model.forward).parameters)

    @property
    def model_features(self) -> bool:
        """Whether the model defines its DSpark features itself (``get_dspark_target_feature_modules``)."""
        return hasattr(self.model, "get_dspark_target_feature_modules")

    def prepare(self, captures: Sequence[Capture]) -> None:
        """Nothing to start: hooks are placed per forward."""

    def close(self) -> None:
        """Nothing to release beyond what garbage collection frees."""

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, capture: Capture, documents: Documents | None = None) -> ForwardOutput:
        """One forward of the batch; a packed batch (``documents``) runs each document as a row of its own, positions
        from 0 and nothing else in view (NeMo's models take no block mask), every row padded to the longest document,
        and what it gives goes back to the document's positions (so any architecture keeps its documents apart)."""
        if documents is None:
            return self._forward(input_ids, attention_mask, capture)
        segments = documents.segments(attention_mask)
        if not segments:  # padding only: nothing real to compute
            return self._forward(input_ids, attention_mask, capture)
        longest = max(len(positions) for _, positions in segments)
        rows_ids = torch.zeros(len(segments), longest, dtype=input_ids.dtype)
        rows_mask = torch.zeros(len(segments), longest, dtype=attention_mask.dtype)
        for index, (row, positions) in enumerate(segments):
            rows_ids[index, : len(positions)], rows_mask[index, : len(positions)] = input_ids[row, positions], 1
        rows = self._forward(rows_ids, rows_mask, capture)
        placed = lambda tensor: _to_documents(tensor, segments, input_ids.shape) if tensor is not None else None  # noqa: E731
        return ForwardOutput(
            layer_outputs={layer: placed(tensor) for layer, tensor in rows.layer_outputs.items()},
            embeddings=placed(rows.embeddings),
            final_hidden=placed(rows.final_hidden),
            logits=placed(rows.logits),
            joined=placed(rows.joined),
        )

    def _forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, capture: Capture) -> ForwardOutput:
        out = ForwardOutput()
        joined = JoinedWriter(capture.joined) if capture.joined is not None else None
        features = [part for part in capture.joined.parts if isinstance(part, ModelFeature)] if capture.joined else []
        with ExitStack() as hooks:
            for layer_id in capture.needed_layer_ids():
                store = store_hook(out, joined, layer_id, layer_id in capture.layer_ids, self.device)
                hooks.callback(self.layers[layer_id].register_forward_hook(store).remove)
            if capture.needs_embeddings():
                store = store_hook(out, joined, EMBEDDINGS, capture.embeddings, self.device)
                hooks.callback(self.layers[0].register_forward_pre_hook(first_input_hook(store), with_kwargs=True).remove)
            if features:
                modules = self.model.get_dspark_target_feature_modules([feature.layer_id for feature in features])
                for feature, module in zip(features, modules, strict=True):
                    store = store_hook(out, joined, feature, False, self.device)
                    hooks.callback(module.register_forward_pre_hook(first_input_hook(store), with_kwargs=True).remove)
            if capture.needs_final_hidden():
                store = store_hook(out, joined, FINAL_HIDDEN, capture.final_hidden, self.device)
                hooks.callback(self.final_norm.register_forward_hook(store).remove)
            arguments = {"input_ids": input_ids.to(self.device), "attention_mask": attention_mask.to(self.device), "use_cache": False}
            result = self.model(**{key: value for key, value in arguments.items() if key in self._accepts})
        release_gathered(self.model)
        if capture.logits:
            logits = result.logits if hasattr(result, "logits") else result
            out.logits = logits.to(self.device)
        if joined is not None:
            out.joined = joined.tensor
        return out

    def update_weights(self, message: UpdateWeights, check_finite: bool, timeout_s: float = 60.0, keys: KeyPair | None = None) -> None:
        """Load the update in place, all or nothing: under the checkpoint's names, whole decoder layers
        (whole_layer_updates.py), mapped to NeMo's by the model's own ``state_dict_adapter`` as at start, every mapped
        tensor checked before any is copied. UpdateRefused; nothing here breaks off after a write."""
        if self._checkpoint is None:
            self._checkpoint = checkpoint_tensors(self.target)
        if message.source is None:
            _, loaders = checked_files("automodel", message.weights or "", self._checkpoint, check_finite)
        else:
            lay_out = lambda specs: [torch.empty(spec.shape, dtype=DTYPES[spec.dtype]) for spec in specs]  # noqa: E731
            loaders = pulled("automodel", message, self._checkpoint, lay_out, check_finite, timeout_s, keys)
        new = {name: load() for name, load in loaders.items()}
        mapped = map_group(self._adapter, dict(new), self._moe_mesh)  # from_hf empties what it is given
        held = self.model.state_dict()
        if (problem := mismatch(held, mapped)) is not None:
            raise UpdateRefused(f"the update's {problem}")
        copy_into(held, mapped)

    def input_embeddings(self) -> torch.Tensor:
        return whole_weight(self.model.get_input_embeddings().weight).detach()

    def output_embeddings(self) -> torch.Tensor:
        return whole_weight(self.model.get_output_embeddings().weight).detach()


def _to_documents(tensor: torch.Tensor, segments: list[tuple[int, torch.Tensor]], shape: torch.Size) -> torch.Tensor:
    """A tensor of document rows [documents, longest, ...] put back at each document's positions of the packed batch
    [B, S, ...] (zeros elsewhere)."""
    out = tensor.new_zeros((*shape, *tensor.shape[2:]))
    for index, (row, positions) in enumerate(segments):
        out[row, positions.to(tensor.device)] = tensor[index, : len(positions)]
    return out
