"""The fake's implementation (see the package docstring). Real sglang semantics it copies:

- ``set_eagle3_layers_to_capture(ids)`` stores ``ids + 1``; before running decoder layer k the model keeps
  ``hidden_states + residual`` (the embeddings for k = 0) when k is stored, i.e. the output of HF layer k - 1;
  a stored L (id L - 1) is never reached and silently gives nothing;
- the logits processor, under ``CaptureHiddenMode.FULL``, stores the concatenated aux states when any were
  captured, else the post-norm hidden states; ``next_token_logits`` are the last position's only;
- the request and KV pools fill up unless cleared;
- tensor parallel: ``ModelRunner(tp_rank=, tp_size=, nccl_port=, ...)`` makes this process rank ``tp_rank`` of a
  torch.distributed group of ``tp_size`` processes met at ``tcp://127.0.0.1:nccl_port`` (``init_distributed_environment``
  and ``initialize_model_parallel``; the fake uses gloo, real sglang NCCL on GPUs, and the fake sets up no group at
  ``tp_size`` 1, where real sglang makes a one-rank one); ``model.embed_tokens`` and ``lm_head`` hold this rank's
  contiguous shard of the vocab, padded (``VocabParallelEmbedding``, ``ParallelLMHead``): the embedding lookup
  all-reduces the ranks' masked lookups and the logits processor all-gathers the logits over the vocab;
  ``tensor_model_parallel_all_gather`` gathers over the group; ``destroy_model_parallel`` /
  ``destroy_distributed_environment`` leave the group.

What the fake does NOT copy: sglang shards every layer (column/row-parallel linears, all-reduced); the fake runs the
decoder layers whole on every rank with transformers. Its collectives (the embedding's all-reduce, the logits'
all-gather, and a check in every forward that every rank runs the same call on the same tokens) make ranks that are
out of step fail or hang, as real sglang's would; they prove nothing about sglang's numerics or its NCCL setup.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
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
    # Across machines (sglang's --dist-init-addr, --nnodes, --node-rank): the group meets at dist_init_addr.
    dist_init_addr: str | None = None
    nnodes: int = 1
    node_rank: int = 0


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


# ---------------------------------------------------------------- parallel state (sglang.srt.distributed)
VOCAB_PADDING = 64
TIMEOUT_S = 120.0  # a rank that does not join, or a collective a peer never enters, fails after this
_TP = {"rank": 0, "size": 1}  # this process's place in the tensor-parallel group, set by initialize_model_parallel
DESTROYED: list[str] = []


def init_distributed_environment(world_size: int, rank: int, distributed_init_method: str, backend: str = "gloo") -> None:
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group(backend, init_method=distributed_init_method, rank=rank, world_size=world_size, timeout=timedelta(seconds=TIMEOUT_S))


def initialize_model_parallel(tensor_model_parallel_size: int) -> None:
    rank = dist.get_rank() if dist.is_initialized() else 0
    size = dist.get_world_size() if dist.is_initialized() else 1
    assert size == tensor_model_parallel_size, (size, tensor_model_parallel_size)
    _TP.update(rank=rank, size=size)


def get_tensor_model_parallel_rank() -> int:
    return _TP["rank"]


def get_tensor_model_parallel_world_size() -> int:
    return _TP["size"]


def tensor_model_parallel_all_reduce(input_: torch.Tensor) -> torch.Tensor:
    if _TP["size"] > 1:
        dist.all_reduce(input_)
    return input_


def tensor_model_parallel_all_gather(input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
    if _TP["size"] == 1:
        return input_
    parts = [torch.empty_like(input_) for _ in range(_TP["size"])]
    dist.all_gather(parts, input_.contiguous())
    return torch.cat(parts, dim=dim)


def destroy_model_parallel() -> None:
    DESTROYED.append("model_parallel")
    _TP.update(rank=0, size=1)


def destroy_distributed_environment() -> None:
    DESTROYED.append("distributed_environment")
    if dist.is_initialized():
        dist.destroy_process_group()


def vocab_shard(weight: torch.Tensor) -> torch.Tensor:
    """This rank's rows of ``weight`` [V, H], its vocab padded with zero rows to a multiple of 64 x tp_size."""
    step = VOCAB_PADDING * _TP["size"]
    padded = -(-weight.shape[0] // step) * step
    full = torch.zeros(padded, weight.shape[1], dtype=weight.dtype)
    full[: weight.shape[0]] = weight
    per = padded // _TP["size"]
    return full[_TP["rank"] * per : (_TP["rank"] + 1) * per].clone()


class VocabParallelEmbedding(nn.Module):
    """This rank's shard of the embeddings; a lookup sums every rank's (zero outside its shard) over the group."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(vocab_shard(weight), requires_grad=False)
        self.start = _TP["rank"] * self.weight.shape[0]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out[outside] = 0
        return tensor_model_parallel_all_reduce(out)


class ParallelLMHead(nn.Module):
    """This rank's shard of lm_head; the logits processor applies it."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(vocab_shard(weight), requires_grad=False)


class LogitsProcessor(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config

    def _get_logits(self, hidden_states: torch.Tensor, lm_head: nn.Module, logits_metadata: LogitsMetadata) -> torch.Tensor:
        logits = tensor_model_parallel_all_gather(F.linear(hidden_states, lm_head.weight))[:, : self.config.vocab_size]
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
        self.model.embed_tokens = VocabParallelEmbedding(hf_model.model.embed_tokens.weight.detach())
        self.lm_head = ParallelLMHead(hf_model.lm_head.weight.detach())
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

        assert isinstance(nccl_port, int) and 0 < nccl_port < 65536 and isinstance(gpu_id, int) and gpu_id >= 0
        assert pp_size == 1 and pp_rank == 0, "the fake runs no pipeline parallelism"
        assert 0 <= tp_rank < tp_size and server_args.tp_size == tp_size, (tp_rank, tp_size, server_args.tp_size)
        assert moe_ep_size == server_args.ep_size and moe_ep_rank == tp_rank // (tp_size // moe_ep_size)
        self.gpu_id, self.tp_rank, self.tp_size, self.nccl_port = gpu_id, tp_rank, tp_size, nccl_port
        self.model_config, self.server_args = model_config, server_args
        # As sglang's ModelRunner: at dist_init_addr when given (across machines), else on loopback at nccl_port.
        where = server_args.dist_init_addr or f"127.0.0.1:{nccl_port}"
        init_distributed_environment(world_size=tp_size, rank=tp_rank, distributed_init_method=f"tcp://{where}")
        initialize_model_parallel(tensor_model_parallel_size=tp_size)
        hf_model = AutoModelForCausalLM.from_pretrained(model_config.model_path, dtype=model_config.dtype)
        self.model = CausalLM(hf_model.eval().requires_grad_(False))
        self.req_to_token_pool = Pool(4)
        self.token_to_kv_pool_allocator = Pool(4096)
        self.forwards = 0

    def forward(self, forward_batch: ForwardBatch) -> ModelRunnerOutput:
        self.forwards += 1
        if self.tp_size > 1:  # every rank runs the same forward, on the same tokens, or none runs it
            ids = forward_batch.input_ids
            mine = torch.tensor([self.forwards, ids.numel(), int(ids.sum()), int((ids * torch.arange(1, ids.numel() + 1)).sum())])
            everyone = tensor_model_parallel_all_gather(mine[None], dim=0)
            if not bool((everyone == mine).all()):
                raise RuntimeError(
                    f"fake sglang: the tensor-parallel ranks ran different forwards ([call, tokens, checksums] per rank: {everyone.tolist()})"
                )
        return ModelRunnerOutput(self.model(forward_batch.input_ids, None, forward_batch))
