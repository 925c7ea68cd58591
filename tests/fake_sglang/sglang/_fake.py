"""The fake's implementation (see the package docstring). Real sglang semantics it copies:

- ``set_eagle3_layers_to_capture(ids)`` stores ``ids + 1``; before running decoder layer k the model keeps
  ``hidden_states + residual`` (the embeddings for k = 0) when k is stored, i.e. the output of HF layer k - 1;
  a stored L (id L - 1) is never reached and silently gives nothing;
- the logits processor, under ``CaptureHiddenMode.FULL``, stores the concatenated aux states when any were
  captured, else the post-norm hidden states; ``next_token_logits`` are the last position's only;
- the request and KV pools fill up unless cleared.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class ServerArgs:
    model_path: str
    dtype: str = "auto"
    device: str | None = None
    tp_size: int = 1
    pp_size: int = 1
    ep_size: int = 1
    mem_fraction_static: float | None = None
    page_size: int = 1
    enable_return_hidden_states: bool = False
    disable_cuda_graph: bool = False
    disable_radix_cache: bool = False
    trust_remote_code: bool = False


class ModelConfig:
    def __init__(self, model_path: str, dtype: str) -> None:
        from transformers import AutoConfig

        self.model_path = model_path
        self.hf_config = AutoConfig.from_pretrained(model_path)
        self.dtype = torch.float32 if dtype == "auto" else getattr(torch, dtype)

    @classmethod
    def from_server_args(cls, server_args: ServerArgs) -> ModelConfig:
        return cls(server_args.model_path, server_args.dtype)


class SpeculativeAlgorithm(enum.Enum):
    NONE = enum.auto()


class CaptureHiddenMode(enum.IntEnum):
    NULL = 0
    LAST = 1
    FULL = 2


@dataclass
class SamplingParams:
    temperature: float = 1.0
    max_new_tokens: int = 128
    top_k: int = -1


class Req:
    def __init__(self, rid: str, origin_input_text: str, origin_input_ids: list[int], sampling_params: SamplingParams) -> None:
        self.rid = rid
        self.origin_input_ids = list(origin_input_ids)
        self.sampling_params = sampling_params
        self.prefix_indices = torch.empty((0,), dtype=torch.int64)
        self.fill_ids: list[int] = []
        self.extend_input_len = 0
        self.logprob_start_len = 0


class Pool:
    """req_to_token_pool and token_to_kv_pool_allocator: a fixed size that clear() frees."""

    def __init__(self, size: int) -> None:
        self.size, self.used = size, 0

    def alloc(self, n: int) -> None:
        if self.used + n > self.size:
            raise RuntimeError("fake sglang: pool is full (was it cleared after the last batch?)")
        self.used += n

    def clear(self) -> None:
        self.used = 0


@dataclass
class CacheInitParams:
    disable: bool
    req_to_token_pool: Pool
    token_to_kv_pool_allocator: Pool
    page_size: int = 1


class RadixCache:
    def __init__(self, params: CacheInitParams) -> None:
        self.params = params


@dataclass
class ScheduleBatch:
    reqs: list[Req]
    req_to_token_pool: Pool
    token_to_kv_pool_allocator: Pool

    @classmethod
    def init_new(
        cls, reqs, req_to_token_pool, token_to_kv_pool_allocator, tree_cache, model_config, enable_overlap, spec_algorithm, **_: Any
    ) -> ScheduleBatch:
        assert isinstance(tree_cache, RadixCache) and spec_algorithm is SpeculativeAlgorithm.NONE
        return cls(list(reqs), req_to_token_pool, token_to_kv_pool_allocator)

    def prepare_for_extend(self) -> None:
        for req in self.reqs:
            assert req.extend_input_len == len(req.fill_ids) - len(req.prefix_indices) > 0
            self.req_to_token_pool.alloc(1)
            self.token_to_kv_pool_allocator.alloc(req.extend_input_len)

    def get_model_worker_batch(self) -> ScheduleBatch:
        return self


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # all requests' new tokens, concatenated
    extend_seq_lens: list[int]
    capture_hidden_mode: CaptureHiddenMode = CaptureHiddenMode.NULL

    @classmethod
    def init_new(cls, batch: ScheduleBatch, model_runner: ModelRunner) -> ForwardBatch:
        ids = [token for req in batch.reqs for token in req.fill_ids[len(req.prefix_indices) :]]
        return cls(torch.tensor(ids, dtype=torch.int64), [req.extend_input_len for req in batch.reqs])


@dataclass
class LogitsMetadata:
    extend_seq_lens: list[int]
    capture_hidden_mode: CaptureHiddenMode

    @classmethod
    def from_forward_batch(cls, batch: ForwardBatch) -> LogitsMetadata:
        return cls(batch.extend_seq_lens, batch.capture_hidden_mode)


@dataclass
class LogitsProcessorOutput:
    next_token_logits: torch.Tensor
    hidden_states: torch.Tensor | None = None


class LogitsProcessor(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config

    def _get_logits(self, hidden_states: torch.Tensor, lm_head: nn.Module, logits_metadata: LogitsMetadata) -> torch.Tensor:
        logits = F.linear(hidden_states, lm_head.weight)[:, : self.config.vocab_size]
        if getattr(self.config, "logit_scale", None) is not None:
            logits = logits * self.config.logit_scale
        if getattr(self.config, "final_logit_softcapping", None) is not None:
            logits = torch.tanh(logits / self.config.final_logit_softcapping) * self.config.final_logit_softcapping
        return logits

    def forward(self, input_ids, hidden_states, lm_head, logits_metadata, aux_hidden_states=None, hidden_states_before_norm=None):
        if isinstance(logits_metadata, ForwardBatch):
            logits_metadata = LogitsMetadata.from_forward_batch(logits_metadata)
        last = torch.tensor(logits_metadata.extend_seq_lens).cumsum(0) - 1
        stored = None
        if logits_metadata.capture_hidden_mode == CaptureHiddenMode.FULL:
            stored = torch.cat(aux_hidden_states, dim=-1) if aux_hidden_states else hidden_states
        return LogitsProcessorOutput(next_token_logits=self._get_logits(hidden_states[last], lm_head, logits_metadata), hidden_states=stored)


class CausalLM(nn.Module):
    """sglang's model layout (``model.embed_tokens``, ``lm_head``, ``logits_processor``) over a transformers model."""

    def __init__(self, hf_model: nn.Module) -> None:
        super().__init__()
        text_config = hf_model.config.get_text_config()
        self.model = hf_model.model
        self.lm_head = hf_model.lm_head
        self.logits_processor = LogitsProcessor(text_config)
        self.layers_to_capture: list[int] = []
        self.capture_aux_hidden_states = False

    def set_eagle3_layers_to_capture(self, layer_ids: list[int] | None = None) -> None:
        self.capture_aux_hidden_states = True
        layers = len(self.model.layers)
        self.layers_to_capture = [2, layers // 2, layers - 3] if layer_ids is None else [i + 1 for i in layer_ids]

    def forward(self, input_ids: torch.Tensor, positions: Any, forward_batch: ForwardBatch) -> LogitsProcessorOutput:
        hidden, aux = [], []
        for ids in input_ids.split(forward_batch.extend_seq_lens):
            entering: dict[int, torch.Tensor] = {}
            hooks = []
            for k in sorted(set(self.layers_to_capture) if self.capture_aux_hidden_states else ()):
                if k == 0:
                    hooks.append(
                        self.model.layers[0].register_forward_pre_hook(
                            lambda m, a, kw, entering=entering: entering.__setitem__(0, kw.get("hidden_states", a[0] if a else None)[0]),
                            with_kwargs=True,
                        )
                    )
                elif k < len(self.model.layers):  # k == L is never entered
                    hooks.append(
                        self.model.layers[k - 1].register_forward_hook(
                            lambda m, a, o, k=k, entering=entering: entering.__setitem__(k, (o[0] if isinstance(o, tuple) else o)[0])
                        )
                    )
            try:
                hidden.append(self.model(input_ids=ids[None], use_cache=False).last_hidden_state[0])
            finally:
                for hook in hooks:
                    hook.remove()
            aux.append([entering[k] for k in sorted(entering)])
        aux_states = [torch.cat(parts) for parts in zip(*aux)] if aux and aux[0] else None
        return self.logits_processor(input_ids, torch.cat(hidden), self.lm_head, forward_batch, aux_states)


@dataclass
class ModelRunnerOutput:
    logits_output: LogitsProcessorOutput
    can_run_graph: bool = False


class ModelRunner:
    def __init__(
        self,
        model_config,
        mem_fraction_static,
        gpu_id,
        tp_rank,
        tp_size,
        moe_ep_rank,
        moe_ep_size,
        pp_rank,
        pp_size,
        nccl_port,
        server_args,
        is_draft_worker=False,
        **_: Any,
    ) -> None:
        from transformers import AutoModelForCausalLM

        assert isinstance(nccl_port, int) and tp_size == 1 and pp_size == 1
        self.model_config, self.server_args = model_config, server_args
        hf_model = AutoModelForCausalLM.from_pretrained(model_config.model_path, dtype=model_config.dtype)
        self.model = CausalLM(hf_model.eval().requires_grad_(False))
        self.req_to_token_pool = Pool(4)
        self.token_to_kv_pool_allocator = Pool(4096)

    def forward(self, forward_batch: ForwardBatch) -> ModelRunnerOutput:
        return ModelRunnerOutput(self.model(forward_batch.input_ids, None, forward_batch))


DESTROYED: list[str] = []


def destroy_model_parallel() -> None:
    DESTROYED.append("model_parallel")


def destroy_distributed_environment() -> None:
    DESTROYED.append("distributed_environment")
