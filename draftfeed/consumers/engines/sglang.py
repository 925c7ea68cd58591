"""The sglang engine: the target under sglang's ``ModelRunner``, aux layers caught by its EAGLE-3 capture.

sglang is driven in-process, below its server, through internal interfaces that move between releases;
the engine is written against sglang 0.5.9 and refuses other versions at start (``SGLANG``; set
DRAFTFEED_SKIP_ENGINE_VERSION_CHECK=1 to try anyway). What it uses, and nothing else:

- ``sglang.srt.server_args.ServerArgs`` (``model_path``, ``dtype``, ``device``, ``enable_return_hidden_states``,
  ``disable_cuda_graph``, ``disable_radix_cache``, ``page_size``, ``mem_fraction_static``, ``tp_size``, ``ep_size``
  and any other field the user passes as ``--engine-option``);
- ``sglang.srt.configs.model_config.ModelConfig.from_server_args``;
- ``sglang.srt.model_executor.model_runner.ModelRunner(model_config=, mem_fraction_static=, gpu_id=, tp_rank=,
  tp_size=, moe_ep_rank=, moe_ep_size=, pp_rank=, pp_size=, nccl_port=, server_args=, is_draft_worker=)``,
  which sets up its own torch.distributed group of ``tp_size`` ranks (``init_distributed_environment`` and
  ``initialize_model_parallel``) at ``tcp://127.0.0.1:nccl_port``, and its ``model``, ``model_config``,
  ``req_to_token_pool``, ``token_to_kv_pool_allocator`` and ``forward(forward_batch).logits_output``;
- the model's ``set_eagle3_layers_to_capture(ids)``, ``logits_processor`` (a ``LogitsProcessor``, whose
  ``_get_logits(hidden_states, lm_head, logits_metadata)`` applies lm_head, the vocab cut and the model's
  logit scaling or soft-capping), ``model.embed_tokens`` and ``lm_head``;
- ``sglang.srt.layers.logits_processor.LogitsMetadata.from_forward_batch``;
- ``sglang.srt.managers.schedule_batch.Req`` and ``ScheduleBatch.init_new(...).prepare_for_extend()``,
  ``get_model_worker_batch()``; ``sglang.srt.mem_cache.radix_cache.RadixCache`` with
  ``sglang.srt.mem_cache.cache_init_params.CacheInitParams`` (disabled: no prefix sharing between requests);
- ``sglang.srt.model_executor.forward_batch_info.ForwardBatch.init_new`` and ``CaptureHiddenMode.FULL``;
- ``sglang.srt.sampling.sampling_params.SamplingParams``, ``sglang.srt.speculative.spec_info.SpeculativeAlgorithm``;
- ``sglang.srt.distributed.parallel_state.destroy_model_parallel`` / ``destroy_distributed_environment`` at close;
- under tensor parallel only, ``sglang.srt.distributed.communication_op.tensor_model_parallel_all_gather(tensor,
  dim)``, to put the vocab shards of ``embed_tokens`` / ``lm_head`` back together.

Tensor parallel (``--tensor-parallel N``, ``parallel``): sglang's own ranks are draftfeed's processes. The worker's
process and the N - 1 it starts (engines/parallel/) each build this engine with their ``ProcessPlace``; each starts a
``ModelRunner`` at ``tp_rank`` = its rank, ``tp_size`` = N, ``gpu_id`` = the index of its device and ``nccl_port`` =
the port every rank shares (``engine_port``), so the N runners form sglang's own group; draftfeed joins no process
group itself. Every call (prepare, each forward, each weight) is made on every rank in the same order, so sglang's
collectives line up. sglang shards the weights and its layers all-reduce, so the captured aux states, the final hidden
state and the logits (all-gathered over the vocab by its logits processor) are whole on every rank; only rank 0's are
kept. The embeddings are vocab shards (``VocabParallelEmbedding`` / ``ParallelLMHead``), gathered over the ranks.
``tp_size`` is set by ``--tensor-parallel`` only, and ``pp_size`` must stay 1.

Layer semantics. sglang's ``set_eagle3_layers_to_capture(ids)`` stores ``hidden_states + residual`` entering
decoder layer id + 1, which is what transformers' layer id returns, so HF layer ids are passed unchanged.
What sglang cannot give, and this engine refuses in ``prepare`` (use the hf or vllm engine instead):

- the last layer L - 1 (there is no layer L to enter): an EAGLE-3 aux id or a DFlash target layer L - 1;
- the embeddings (the input of decoder layer 0: DSpark's layer id -1, ViSpec's ``inputs_embeds``).

Logits and the final hidden state over every position: the model hands its logits processor the post-norm hidden
state of every token (with ``CaptureHiddenMode.FULL`` and aux layers or not: the aux states travel beside it). The
engine wraps the processor (``FullLogits``) and keeps, as asked, that hidden state (the final norm's output: EAGLE-1/2,
ViSpec, DSpark's id L - 1, the compact forms) and ``_get_logits`` of all positions, i.e. sglang's own lm_head,
scaling and soft-capping, not a rebuild.

Each row of a batch runs as its own request holding only its real tokens (attention_mask 1, in order);
results go back to those positions of zero tensors, and the request and KV pools are cleared after each. The logits
are put back in the model's dtype, as the other engines return them.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from draftfeed.consumers.engines.base import FINAL_HIDDEN, Capture, ForwardOutput, TargetShape, request_segments
from draftfeed.consumers.engines.hf import resolve_dtype
from draftfeed.consumers.engines.joining import JoinedWriter
from draftfeed.consumers.engines.packages import EnginePackage, import_engine_package, refuse_own_options
from draftfeed.consumers.engines.parallel.group import use_interface
from draftfeed.consumers.engines.parallel.spec import ProcessPlace
from draftfeed.contract.packing import Documents
from draftfeed.net import free_port
from draftfeed.schemas.messages import LogitTransform

log = logging.getLogger(__name__)

SGLANG = EnginePackage(module="sglang", distributions="sglang", minimum=(0, 5, 9), below=(0, 6))
# ServerArgs fields the engine sets itself; every other --engine-option goes to ServerArgs unchanged.
OWN_OPTIONS = ("model_path", "dtype", "device", "enable_return_hidden_states", "disable_cuda_graph", "disable_radix_cache")
INSTEAD = "use --engine hf or vllm"
# ServerArgs fields draftfeed's own flags decide (why each is refused as an --engine-option).
PARALLEL_OPTIONS = {
    "tp_size": "set --tensor-parallel N instead (N processes, each an sglang ModelRunner at its tp_rank)",
    "pp_size": "the sglang engine does not run sglang's pipeline parallelism; spread the target with --tensor-parallel N",
    "nnodes": "set --nnodes N instead (one `draftfeed launch worker` line on each machine)",
    "node_rank": "set --node-rank instead",
    "dist_init_addr": "set --master-addr HOST:PORT instead (node 0's address)",
}


def refuse_parallel_options(options: dict[str, Any]) -> None:
    """Raise ValueError if ``--engine-option`` sets sglang's tensor or pipeline parallel size (PARALLEL_OPTIONS says why)."""
    for key in sorted(set(options) & set(PARALLEL_OPTIONS)):
        if key == "pp_size" and options[key] == 1:
            continue
        raise ValueError(f"--engine-option {key}: {PARALLEL_OPTIONS[key]}")


def refusal(capture: Capture, num_hidden_layers: int) -> str | None:
    """Why sglang cannot give ``capture``, or None when it can."""
    last = num_hidden_layers - 1
    if capture.needs_embeddings():
        return (
            "the sglang engine cannot capture the embeddings (the input of decoder layer 0: DSpark's layer id -1, "
            f"ViSpec's inputs_embeds): sglang's EAGLE-3 capture holds only the outputs of layers 0..{last - 1}; {INSTEAD}"
        )
    bad = [i for i in capture.needed_layer_ids() if not 0 <= i < last]
    if bad:
        return (
            f"the sglang engine cannot capture layer ids {bad} of a {num_hidden_layers}-layer target: sglang captures "
            f"the input of layer id + 1, so only ids 0..{last - 1} exist, not the last layer {last}'s output (pre-norm); "
            f"choose layers below {last}, or {INSTEAD}"
        )
    return None


SGLANG_IMAGES_REFUSAL = "engine sglang takes no image inputs in draftfeed: serve image-text batches with --engine hf"


class FullLogits(nn.Module):
    """Stands in for the model's logits processor: passes its output through unchanged and, while asked, also keeps
    the post-norm hidden state it is handed (``keep_hidden``) and the logits over every position (``keep``:
    sglang's own ``_get_logits``)."""

    def __init__(self, inner: nn.Module, metadata_class: Any) -> None:
        super().__init__()
        self.inner = inner
        self.metadata_class = metadata_class
        self.keep = False
        self.keep_hidden = False
        self.logits: torch.Tensor | None = None
        self.hidden: torch.Tensor | None = None

    def forward(self, input_ids: Any, hidden_states: torch.Tensor, lm_head: nn.Module, logits_metadata: Any, *args: Any, **kwargs: Any) -> Any:
        if self.keep_hidden:
            self.hidden = hidden_states.clone()  # taken before the processor runs, which may prune or reuse it
        output = self.inner(input_ids, hidden_states, lm_head, logits_metadata, *args, **kwargs)
        if self.keep:
            metadata = logits_metadata
            if not isinstance(metadata, self.metadata_class):
                metadata = self.metadata_class.from_forward_batch(logits_metadata)
            self.logits = self.inner._get_logits(hidden_states, lm_head, metadata)
        return output

    def take(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The kept (hidden state, logits), each None unless asked; a RuntimeError if the processor was not called."""
        hidden, logits = self.hidden, self.logits
        self.hidden = self.logits = None
        if (self.keep_hidden and hidden is None) or (self.keep and logits is None):
            raise RuntimeError("sglang's logits processor was not called during the forward")
        return hidden, logits

    def reset(self) -> None:
        self.keep = self.keep_hidden = False
        self.hidden = self.logits = None


class SGLangEngine:
    """An sglang ``ModelRunner`` started once the task has said what it will capture (``prepare``).

    ``parallel``: this process is rank ``parallel.rank`` of a tensor-parallel worker, its runner sglang's
    ``tp_rank`` of ``parallel.world_size`` on ``parallel.device`` (the module docstring says how).
    """

    name = "sglang"
    image_inputs: frozenset[str] = frozenset()
    images_refusal = SGLANG_IMAGES_REFUSAL

    def __init__(self, target: str, device: str = "cuda", dtype: str = "auto", parallel: ProcessPlace | None = None, **server_options: Any) -> None:
        self._sglang = import_engine_package(SGLANG)
        from transformers import AutoConfig

        self.target = target
        self.parallel = parallel
        self.device = torch.device(parallel.device if parallel is not None else device)
        self.dtype = resolve_dtype(dtype, self.device)
        refuse_own_options("sglang", server_options, OWN_OPTIONS)
        refuse_parallel_options(server_options)
        self.server_options = server_options
        text_config = AutoConfig.from_pretrained(target).get_text_config()
        self.shape = TargetShape.from_text_config(text_config)
        self.logit_transform = LogitTransform.from_text_config(text_config)
        self._ids: tuple[int, ...] = ()
        self._runner: Any = None
        self._logits: FullLogits | None = None
        self._requests = 0

    @property
    def tp_size(self) -> int:
        return 1 if self.parallel is None else self.parallel.world_size

    # ---------------------------------------------------------------- start
    def prepare(self, captures: Sequence[Capture]) -> None:
        for capture in captures:
            reason = refusal(capture, self.shape.num_hidden_layers)
            if reason is not None:
                raise ValueError(reason)
        ids = tuple(sorted({i for capture in captures for i in capture.needed_layer_ids()} | set(self._ids)))
        if self._runner is None:
            self._start()
        if ids != self._ids and ids:
            self._runner.model.set_eagle3_layers_to_capture(list(ids))
        self._ids = ids

    def _start(self) -> None:
        from sglang.srt.configs.model_config import ModelConfig
        from sglang.srt.layers.logits_processor import LogitsMetadata
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.radix_cache import RadixCache
        from sglang.srt.model_executor.model_runner import ModelRunner
        from sglang.srt.server_args import ServerArgs

        nodes: dict[str, Any] = {}
        if self.parallel is not None:
            use_interface(self.parallel)  # sglang's gloo or NCCL group binds to the interface towards node 0
        if self.parallel is not None and self.parallel.nnodes > 1:
            # Across machines sglang's group meets at node 0's address (as sglang's own --dist-init-addr, --nnodes and
            # --node-rank place its ranks), on the port node 0's rank 0 chose there.
            nodes = {
                "dist_init_addr": f"{self.parallel.store_host}:{self.parallel.engine_port}",
                "nnodes": self.parallel.nnodes,
                "node_rank": self.parallel.node_rank,
            }
        args = ServerArgs(
            model_path=self.target,
            dtype=str(self.dtype).removeprefix("torch."),
            device=self.device.type,
            enable_return_hidden_states=True,
            disable_cuda_graph=True,  # one extend per request, of any length
            disable_radix_cache=True,  # no prefix sharing between requests
            tp_size=self.tp_size,
            **nodes,
            **self.server_options,
        )
        tp_size = self.tp_size
        tp_rank = 0 if self.parallel is None else self.parallel.rank
        if args.pp_size != 1:
            raise ValueError(f"--engine-option pp_size={args.pp_size}: {PARALLEL_OPTIONS['pp_size']}")
        if args.ep_size < 1 or tp_size % args.ep_size:
            raise ValueError(f"--engine-option ep_size={args.ep_size} must divide the tensor-parallel size {tp_size} (sglang's rule)")
        log.info(
            "sglang engine: starting sglang %s on %s (tp_rank %d of %d, %s)", self._sglang.__version__, self.target, tp_rank, tp_size, self.device
        )
        runner = ModelRunner(
            model_config=ModelConfig.from_server_args(args),
            mem_fraction_static=args.mem_fraction_static,
            gpu_id=self.device.index or 0,
            tp_rank=tp_rank,
            tp_size=tp_size,
            moe_ep_rank=tp_rank // (tp_size // args.ep_size),  # as sglang's scheduler places its expert-parallel ranks
            moe_ep_size=args.ep_size,
            pp_rank=0,
            pp_size=1,
            # sglang's torch.distributed group: one rank of its own, or the port every rank of the worker shares
            nccl_port=free_port() if self.parallel is None else self.parallel.engine_port,
            server_args=args,
            is_draft_worker=False,
        )
        processor = getattr(runner.model, "logits_processor", None)
        if not isinstance(processor, nn.Module):
            raise ValueError(
                f"sglang's {type(runner.model).__name__} has no logits_processor module; the sglang engine reads full logits from it; {INSTEAD}"
            )
        if not hasattr(runner.model, "set_eagle3_layers_to_capture"):
            raise ValueError(f"sglang's {type(runner.model).__name__} has no EAGLE-3 layer capture (set_eagle3_layers_to_capture); {INSTEAD}")
        self._logits = FullLogits(processor, LogitsMetadata)
        runner.model.logits_processor = self._logits
        self._tree_cache = RadixCache(
            CacheInitParams(
                disable=True,
                req_to_token_pool=runner.req_to_token_pool,
                token_to_kv_pool_allocator=runner.token_to_kv_pool_allocator,
                page_size=args.page_size,
            )
        )
        self._runner = runner

    # ---------------------------------------------------------------- forward
    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, capture: Capture, documents: Documents | None = None) -> ForwardOutput:
        if self._runner is None:
            raise RuntimeError("SGLangEngine.forward before prepare(): the task starts the engine")
        reason = refusal(capture, self.shape.num_hidden_layers)
        if reason is not None:
            raise ValueError(reason)
        if not set(capture.needed_layer_ids()) <= set(self._ids):
            raise ValueError(f"layer ids {sorted(set(capture.needed_layer_ids()) - set(self._ids))} were not prepared")
        batch, seq = input_ids.shape
        hidden = self.shape.hidden_size

        def zeros(width: int) -> torch.Tensor:
            return torch.zeros(batch, seq, width, dtype=self.dtype, device=self.device)

        out = ForwardOutput(
            layer_outputs={i: zeros(hidden) for i in capture.layer_ids},
            final_hidden=zeros(hidden) if capture.final_hidden else None,
            logits=zeros(self.shape.vocab_size) if capture.logits else None,
        )
        # The joined parts go straight into the joined tensor: the worker holds one copy of them.
        joined = JoinedWriter.allocated(capture.joined, (batch, seq), hidden, self.dtype, self.device) if capture.joined is not None else None
        want_final, needed = capture.needs_final_hidden(), capture.needed_layer_ids()
        for row, positions in request_segments(attention_mask, documents):  # a row, or a packed row's document, is one request
            aux, final, logits = self._extend(input_ids[row, positions].tolist(), want_final=want_final, want_logits=capture.logits)
            positions = positions.to(self.device)
            for i in needed:
                if i in capture.layer_ids:
                    out.layer_outputs[i][row, positions] = aux[i].to(self.device, self.dtype)
                if joined is not None and joined.wants(i):
                    joined.write(i, aux[i].to(self.device, self.dtype), at=(row, positions))
            if final is not None:
                if out.final_hidden is not None:
                    out.final_hidden[row, positions] = final.to(self.device, self.dtype)
                if joined is not None and joined.wants(FINAL_HIDDEN):
                    joined.write(FINAL_HIDDEN, final.to(self.device, self.dtype), at=(row, positions))
            if out.logits is not None and logits is not None:
                out.logits[row, positions] = logits.to(self.device, self.dtype)
        out.joined = joined.tensor if joined is not None else None
        return out

    def _extend(
        self, tokens: list[int], want_final: bool, want_logits: bool
    ) -> tuple[dict[int, torch.Tensor], torch.Tensor | None, torch.Tensor | None]:
        """One request's prefill: the captured layers {id: [n, H]} and, when wanted, its final hidden state [n, H]
        (post-norm) and its logits [n, V]."""
        from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
        from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch
        from sglang.srt.sampling.sampling_params import SamplingParams
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        runner, head = self._runner, self._logits
        assert head is not None
        self._requests += 1
        req = Req(
            rid=f"draftfeed-{self._requests}",
            origin_input_text="",
            origin_input_ids=tokens,
            sampling_params=SamplingParams(temperature=0, max_new_tokens=1),
        )
        req.fill_ids = req.origin_input_ids
        req.extend_input_len = len(req.fill_ids) - len(req.prefix_indices)
        req.logprob_start_len = len(tokens) - 1
        head.keep, head.keep_hidden = want_logits, want_final
        try:
            batch = ScheduleBatch.init_new(
                reqs=[req],
                req_to_token_pool=runner.req_to_token_pool,
                token_to_kv_pool_allocator=runner.token_to_kv_pool_allocator,
                tree_cache=self._tree_cache,
                model_config=runner.model_config,
                enable_overlap=False,
                spec_algorithm=SpeculativeAlgorithm.NONE,
            )
            batch.prepare_for_extend()
            forward_batch = ForwardBatch.init_new(batch.get_model_worker_batch(), runner)
            forward_batch.capture_hidden_mode = CaptureHiddenMode.FULL
            output = runner.forward(forward_batch).logits_output
            final, logits = head.take()
        finally:
            head.reset()
            runner.req_to_token_pool.clear()
            runner.token_to_kv_pool_allocator.clear()
        aux: dict[int, torch.Tensor] = {}
        if self._ids:
            stored = output.hidden_states  # the captured layers, in increasing id order, concatenated: [n, len(ids) * H]
            expected = (len(tokens), len(self._ids) * self.shape.hidden_size)
            if stored is None or tuple(stored.shape) != expected:
                got = None if stored is None else tuple(stored.shape)
                raise RuntimeError(f"sglang returned captured hidden states of shape {got}; expected {expected} for ids {list(self._ids)}")
            aux = dict(zip(self._ids, stored.split(self.shape.hidden_size, dim=-1)))
        if final is not None and tuple(final.shape) != (len(tokens), self.shape.hidden_size):
            raise RuntimeError(f"sglang's final hidden state has shape {tuple(final.shape)}; expected {(len(tokens), self.shape.hidden_size)}")
        if logits is not None and tuple(logits.shape) != (len(tokens), self.shape.vocab_size):
            raise RuntimeError(f"sglang's logits have shape {tuple(logits.shape)}; expected {(len(tokens), self.shape.vocab_size)}")
        return aux, final, logits

    # ---------------------------------------------------------------- weights, close
    def _weight(self, path: str) -> torch.Tensor:
        if self._runner is None:
            raise RuntimeError(f"SGLangEngine: {path} is read from sglang's model, which starts in prepare()")
        module: Any = self._runner.model
        for part in path.split("."):
            module = getattr(module, part, None)
        if not isinstance(module, torch.Tensor):
            raise ValueError(
                f"sglang's {type(self._runner.model).__name__} has no {path}; the sglang engine reads the target's embeddings there; {INSTEAD}"
            )
        weight = module.detach()
        if self.tp_size > 1:  # each rank holds a contiguous shard of the padded vocab, in rank order
            from sglang.srt.distributed.communication_op import tensor_model_parallel_all_gather

            weight = tensor_model_parallel_all_gather(weight.contiguous(), dim=0)
        weight = weight[: self.shape.vocab_size]  # sglang pads the vocab of its embeddings and lm_head
        if tuple(weight.shape) != (self.shape.vocab_size, self.shape.hidden_size):
            raise ValueError(f"sglang's {path} has shape {tuple(module.shape)}, not [{self.shape.vocab_size}, {self.shape.hidden_size}]")
        return weight.to(self.device)

    def input_embeddings(self) -> torch.Tensor:
        return self._weight("model.embed_tokens.weight")

    def output_embeddings(self) -> torch.Tensor:
        return self._weight("lm_head.weight")

    def close(self) -> None:
        if self._runner is None:
            return
        self._runner = None
        self._logits = None
        self._tree_cache = None
        try:
            from sglang.srt.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

            destroy_model_parallel()
            destroy_distributed_environment()
        except Exception as exc:  # closing must not fail the worker's shutdown
            log.warning("sglang engine: could not tear down sglang's process groups: %s", exc)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
