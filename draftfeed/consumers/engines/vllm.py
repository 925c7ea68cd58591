"""The vllm engine: the target under vLLM, layers captured by its ``extract_hidden_states`` method.

vLLM's speculative method ``extract_hidden_states`` runs a dummy draft that stores the hidden states of
chosen layers in a KV-cache group; a hidden-states KV connector writes them, one safetensors file per
request, when the request finishes. vLLM's capture id k is the input of decoder layer k (hidden states
plus residual), so:

- id 0 is the embeddings (the input of layer 0);
- id i + 1 is the output of decoder layer i (what transformers' layer i returns);
- id L is the last layer's output, before the final norm.

vLLM returns no logits. The final hidden state and the logits are rebuilt from id L with the target's
own final norm and lm_head, loaded by transformers (``TargetHead``), and its logit scaling or soft-capping.

Each row of a batch (each document of a packed row) runs as its own prompt holding only its real tokens (attention_mask 1, in order);
results go back to those positions, and padded positions are left for the task to fill.

Tensor parallel: ``tensor_parallel=N`` is vLLM's ``tensor_parallel_size``. vLLM replicates the hidden states on every
rank, and only TP rank 0 writes the hidden-states file (the stock connector and ``SyncHiddenStatesConnector`` alike).
On CUDA, ``devices`` become ``CUDA_VISIBLE_DEVICES`` for vLLM's workers; on CPU each rank gets its own share of this
process's cores through ``VLLM_CPU_OMP_THREADS_BIND`` (vLLM refuses more than one CPU rank without it). Pipeline
parallelism is refused: vLLM 0.32 does not run the ``extract_hidden_states`` capture under it.

An engine that can no longer compute through no fault of the batch (vLLM's engine core died: ``EngineDeadError``; or,
over machines, a node fell silent) raises EngineLost: the worker hands the batch back uncharged and stops (loss.py).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

import torch

from draftfeed.consumers.devices import NO_PIPELINE
from draftfeed.consumers.engines.base import EMBEDDINGS, FINAL_HIDDEN, Capture, EngineLost, ForwardOutput, Part, request_segments
from draftfeed.consumers.engines.hf import resolve_dtype
from draftfeed.consumers.engines.joining import JoinedWriter
from draftfeed.consumers.engines.loading import transformers_config
from draftfeed.consumers.engines.packages import EnginePackage, import_engine_package, refuse_own_options
from draftfeed.consumers.engines.parallel.loss import EngineLoss, LossReported, sigterm_self
from draftfeed.consumers.engines.parallel.rendezvous import DEFAULT_JOIN_TIMEOUT_S
from draftfeed.consumers.engines.target_head import TargetHead
from draftfeed.consumers.engines.vllm_environment import cpu_start_environment, environment
from draftfeed.consumers.engines.vllm_nodes import NodeZero
from draftfeed.consumers.engines.vllm_updates import VLLMUpdates
from draftfeed.consumers.nodes import NodePlan
from draftfeed.contract.packing import Documents
from draftfeed.dataplane.weights.worker import UpdateRefused
from draftfeed.processes.children import kill_descendants
from draftfeed.schemas.messages import UpdateWeights
from draftfeed.security.keys import KeyPair

log = logging.getLogger(__name__)

VLLM = EnginePackage(module="vllm", distributions="vllm (CUDA) or vllm-cpu (CPU)", minimum=(0, 32), below=(0, 33))
SYNC_CONNECTOR = ("SyncHiddenStatesConnector", "draftfeed.consumers.engines.vllm_connector")
STOCK_CONNECTOR = "ExampleHiddenStatesConnector"
# Options the engine sets itself; everything else in engine_options goes to vllm.LLM unchanged.
OWN_OPTIONS = ("model", "dtype", "speculative_config", "kv_transfer_config", "enable_chunked_prefill", "skip_tokenizer_init")
# vllm.LLM options the engine does not pass on, and what to do instead.
PARALLEL_OPTIONS = {
    "tensor_parallel_size": "set --tensor-parallel N instead",
    "nnodes": "set --nnodes instead (every machine runs the same line with its --node-rank)",
    "node_rank": "set --node-rank instead",
    "master_addr": "set --master-addr instead (node 0's address; draftfeed picks vLLM's port there)",
    "master_port": "set --master-addr instead (node 0's address; draftfeed picks vLLM's port there)",
    "pipeline_parallel_size": NO_PIPELINE["vllm"],
    "enable_expert_parallel": "set --expert-parallel instead",
}


def capture_ids(captures: Sequence[Capture], num_hidden_layers: int) -> tuple[int, ...]:
    """vLLM capture ids (sorted, distinct, as vLLM stores them) that cover every capture."""
    ids: set[int] = {num_hidden_layers}  # the pre-norm last hidden state: final_hidden and logits come from it
    for capture in captures:
        ids.update(layer_id + 1 for layer_id in capture.needed_layer_ids())
        if capture.needs_embeddings():
            ids.add(0)
    return tuple(sorted(ids))


def _vllm_id(part: Part) -> int:
    """The vLLM capture id of a joined part other than the final norm's output (which the head computes)."""
    return 0 if part == EMBEDDINGS else int(part) + 1


def refuse_parallel_options(options: dict[str, Any]) -> None:
    """Raise ValueError if ``--engine-option`` names vLLM's tensor or pipeline parallel size (PARALLEL_OPTIONS says why)."""
    for key in sorted(set(options) & set(PARALLEL_OPTIONS)):
        raise ValueError(f"--engine-option {key}: {PARALLEL_OPTIONS[key]}")


def rank_devices(device: torch.device, tensor_parallel: int, devices: Sequence[str] | None) -> list[torch.device] | None:
    """The device of each rank, checked against ``device`` and ``tensor_parallel``; None when vLLM places the ranks.

    On CPU every rank runs on this machine's cores, so ``devices`` may only say "cpu"; on CUDA each rank needs a GPU
    with an index, each a different one.
    """
    if tensor_parallel < 1:
        raise ValueError(f"--tensor-parallel {tensor_parallel}: give 1 or more ranks")
    if devices is None:
        return None
    named = ",".join(devices)
    if len(devices) != tensor_parallel:
        raise ValueError(f"--devices {named} names {len(devices)} devices but --tensor-parallel is {tensor_parallel}: give one device per rank")
    parsed = [torch.device(name) for name in devices]
    if device.type == "cpu":
        if any(rank.type != "cpu" for rank in parsed):
            raise ValueError(f"--devices {named} with --device cpu: vLLM's CPU ranks share this machine's cores; leave --devices out")
        return None
    if any(rank.type != "cuda" or rank.index is None for rank in parsed) or len(set(parsed)) != len(parsed):
        raise ValueError(f"--devices {named} with --device {device}: name a different GPU for each rank, e.g. cuda:2,cuda:3")
    return parsed


def show_gpus(ranks: Sequence[torch.device]) -> torch.device:
    """Set CUDA_VISIBLE_DEVICES to the ranks' GPUs for vLLM's workers; return where the first of them is in this process.

    Indices count within an existing CUDA_VISIBLE_DEVICES, as torch counts them. Once CUDA has started in this process
    the variable no longer changes what this process sees, so its own tensors stay on the GPU it names.
    """
    visible = [name for name in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if name.strip()]
    indices = [int(rank.index) for rank in ranks]  # type: ignore[arg-type]
    if visible and max(indices) >= len(visible):
        raise ValueError(f"--devices {','.join(map(str, ranks))}: CUDA_VISIBLE_DEVICES={','.join(visible)} shows only {len(visible)} GPUs")
    chosen = ",".join(visible[index] if visible else str(index) for index in indices)
    started = torch.cuda.is_initialized()
    os.environ["CUDA_VISIBLE_DEVICES"] = chosen
    log.info("vllm engine: CUDA_VISIBLE_DEVICES=%s for its %d tensor-parallel ranks", chosen, len(ranks))
    return ranks[0] if started else torch.device("cuda", 0)


def capture_problem(target: str) -> str | None:
    """Why vLLM cannot capture the hidden states of ``target``'s architecture, or None: the capture is vLLM's EAGLE-3
    interface (the aux hidden states a speculator reads), which some of its model classes do not implement (GLM-4-MoE
    in vLLM 0.32); known before the engine starts, so said in one line instead of a failed engine core."""
    from vllm.model_executor.models import ModelRegistry
    from vllm.model_executor.models.interfaces import supports_eagle3

    for architecture in getattr(transformers_config(target), "architectures", None) or []:
        try:
            model_class = ModelRegistry._try_load_model_cls(architecture)  # vLLM's own lookup, without a model config
        except Exception:  # a registry that changed shape: let vLLM's start say what it says
            return None
        if model_class is not None and not supports_eagle3(model_class):
            return (
                f"engine vllm captures hidden states through vLLM's EAGLE-3 interface, which vLLM's {model_class.__name__} "
                "does not implement: serve this target with --engine hf"
            )
    return None


def storage_root() -> str | None:
    """Where the connector writes: /dev/shm (memory) where it exists, else the system temp folder."""
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


VLLM_IMAGES_REFUSAL = (
    "engine vllm takes no image inputs in draftfeed (and vllm-cpu lacks torchvision for Qwen-VL): serve image-text batches with --engine hf"
)


class VLLMEngine(LossReported):
    """A vllm.LLM started once the task has said what it will capture (``prepare``)."""

    name = "vllm"
    image_inputs: frozenset[str] = frozenset()
    images_refusal = VLLM_IMAGES_REFUSAL

    def __init__(
        self,
        target: str,
        device: str = "cpu",
        dtype: str = "auto",
        tensor_parallel: int = 1,
        devices: Sequence[str] | None = None,
        pipeline_parallel: int = 1,
        expert_parallel: bool = False,
        nodes: NodePlan | None = None,
        plan: dict[str, Any] | None = None,
        join_timeout_s: float = DEFAULT_JOIN_TIMEOUT_S,
        on_lost: Callable[[str], None] = sigterm_self,
        **llm_options: Any,
    ) -> None:
        if pipeline_parallel > 1:
            raise ValueError(f"--pipeline-parallel {pipeline_parallel}: {PARALLEL_OPTIONS['pipeline_parallel_size']}")
        self._vllm = import_engine_package(VLLM)
        self.target = target
        if (problem := capture_problem(target)) is not None:
            raise ValueError(problem)
        self.device = torch.device(device)
        refuse_own_options("vllm", llm_options, OWN_OPTIONS)
        refuse_parallel_options(llm_options)
        local = tensor_parallel // nodes.nnodes if nodes is not None else tensor_parallel  # this machine's ranks
        ranks = rank_devices(self.device, local, devices)
        if ranks is not None:
            self.device = show_gpus(ranks)
        elif self.device.type == "cuda" and self.device.index not in (None, 0):
            raise ValueError(
                f"--device {device}: vLLM places the target on the first visible GPU; "
                f"select the GPU with CUDA_VISIBLE_DEVICES={self.device.index} and pass --device cuda"
            )
        self._start_environment = cpu_start_environment(local) if self.device.type == "cpu" else {}
        self.tensor_parallel = tensor_parallel
        self.dtype = resolve_dtype(dtype, self.device)
        self.llm_options = llm_options | ({"enable_expert_parallel": True} if expert_parallel else {})
        self.head = TargetHead(target, self.device, self.dtype)
        self.shape = self.head.shape
        self.logit_transform = self.head.logit_transform
        self._ids: tuple[int, ...] = ()
        self._llm: Any = None
        self._storage: str | None = None
        self._updates: VLLMUpdates | None = None
        # A node lost, or vLLM's engine dead: the worker stops; stuck, it ends with vLLM's processes (loss.py).
        self._loss = EngineLoss(on_lost, kill=kill_descendants)
        # Over machines: the other nodes join here first, then take vLLM's arguments from node 0 (vllm_nodes.py).
        self._nodes = NodeZero(nodes, plan, join_timeout_s, self._loss.lose) if nodes is not None else None
        if self._nodes is not None:
            self._start_environment |= self._nodes.environment()

    # ---------------------------------------------------------------- start
    def prepare(self, captures: Sequence[Capture]) -> None:
        ids = capture_ids(captures, self.shape.num_hidden_layers)
        if self._llm is not None:
            if set(ids) <= set(self._ids):
                return
            raise ValueError(f"the vllm engine already captures ids {list(self._ids)}; it cannot add {sorted(set(ids) - set(self._ids))}")
        self._ids = ids
        self._storage = tempfile.mkdtemp(prefix="draftfeed-vllm-", dir=storage_root())
        connector: dict[str, Any] = {"kv_role": "kv_producer", "kv_connector_extra_config": {"shared_storage_path": self._storage}}
        if self.device.type == "cuda":
            connector["kv_connector"] = STOCK_CONNECTOR
        else:
            connector["kv_connector"], connector["kv_connector_module_path"] = SYNC_CONNECTOR
        log.info(
            "vllm engine: starting vLLM %s on %s, tensor parallel %d, capture ids %s",
            self._vllm.__version__,
            self.target,
            self.tensor_parallel,
            list(ids),
        )
        with environment(self._start_environment):
            self._llm = self._start(ids, connector)
        self._loss.started = True
        self._sampling = self._vllm.SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)

    def _start(self, ids: tuple[int, ...], connector: dict[str, Any]) -> Any:
        """vllm.LLM with the capture of ``ids``, written through ``connector``; over machines, at node rank 0, its
        arguments published first for the other nodes."""
        arguments = (
            {
                "model": self.target,
                "dtype": str(self.dtype).removeprefix("torch."),
                "skip_tokenizer_init": True,
                "tensor_parallel_size": self.tensor_parallel,
                "enable_chunked_prefill": False,  # a prompt's hidden states come out of one prefill
                "speculative_config": {
                    "method": "extract_hidden_states",
                    "num_speculative_tokens": 1,
                    "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(ids)}},
                },
                "kv_transfer_config": connector,
            }
            | {"enforce_eager": True}
            | self.llm_options
        )
        if self._nodes is not None:
            arguments |= self._nodes.placement()
            self._nodes.publish(arguments)
        return self._vllm.LLM(**arguments)

    # ---------------------------------------------------------------- forward
    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, capture: Capture, documents: Documents | None = None) -> ForwardOutput:
        if self._llm is None:
            raise RuntimeError("VLLMEngine.forward before prepare(): the task starts the engine")
        needed = capture_ids([capture], self.shape.num_hidden_layers)
        if not set(needed) <= set(self._ids):
            raise ValueError(f"capture ids {sorted(set(needed) - set(self._ids))} were not prepared")
        batch, seq = input_ids.shape
        segments = request_segments(attention_mask, documents)  # a row, or a packed row's document, is one prompt
        prompts = [{"prompt_token_ids": input_ids[row, positions].tolist()} for row, positions in segments]
        layers = self.shape.num_hidden_layers
        # The ids kept alone (vLLM's: 0 the embeddings, i + 1 layer i's output, L the final norm's input); the joined
        # parts go straight into the joined tensor, so the worker holds one copy of them.
        alone = {i + 1 for i in capture.layer_ids} | ({0} if capture.embeddings else set())
        alone |= {layers} if capture.needs_final_hidden() or capture.logits else set()
        hidden_size = self.shape.hidden_size
        kept = {i: torch.zeros(batch, seq, hidden_size, dtype=self.dtype, device=self.device) for i in sorted(alone)}
        joined = JoinedWriter.allocated(capture.joined, (batch, seq), hidden_size, self.dtype, self.device) if capture.joined else None
        parts = {_vllm_id(part): part for part in capture.joined.parts if part != FINAL_HIDDEN} if capture.joined else {}
        if prompts:
            outputs = self._generate(prompts)
            for (row, positions), prompt, output in zip(segments, prompts, outputs, strict=True):
                hidden = self._load(output, prompt["prompt_token_ids"])  # [n, len(ids), H]
                at = (row, positions.to(self.device))
                for column, vllm_id in enumerate(self._ids):
                    if vllm_id in kept:
                        kept[vllm_id][at] = hidden[:, column].to(self.device, self.dtype)
                    if joined is not None and vllm_id in parts:
                        joined.write(parts[vllm_id], hidden[:, column].to(self.device, self.dtype), at=at)
        out = ForwardOutput(layer_outputs={i: kept[i + 1] for i in capture.layer_ids})
        if capture.embeddings:
            out.embeddings = kept[0]
        if capture.needs_final_hidden() or capture.logits:
            final = self.head.final_hidden(kept[layers])
            out.final_hidden = final if capture.final_hidden else None
            out.logits = self.head.logits(final) if capture.logits else None
            if joined is not None and joined.wants(FINAL_HIDDEN):
                joined.write(FINAL_HIDDEN, final)
        out.joined = joined.tensor if joined is not None else None
        return out

    def _generate(self, prompts: list[dict[str, Any]]) -> list[Any]:
        """vLLM's outputs of ``prompts``; EngineLost when vLLM cannot compute any more through no fault of theirs."""
        from vllm.v1.engine.exceptions import EngineDeadError

        if self.lost is not None:
            raise EngineLost(f"the worker cannot compute: {self.lost}")
        try:
            return self._llm.generate(prompts, self._sampling, use_tqdm=False)
        except Exception as exc:
            if isinstance(exc, EngineDeadError):
                self._loss.found(f"vLLM's engine core died ({type(exc).__name__}; vLLM's log above says why)")
            if self.lost is None:  # the batch's own failure
                raise
            raise EngineLost(f"the worker cannot compute: {self.lost}") from exc

    def _load(self, output: Any, token_ids: list[int]) -> torch.Tensor:
        """Read one request's hidden states file, check it is that request's, and delete it."""
        from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
            cleanup_hidden_states,
            load_hidden_states,
        )

        params = output.kv_transfer_params or {}
        path = params.get("hidden_states_path")
        if path is None:
            raise RuntimeError(f"vLLM returned no hidden_states_path for request {output.request_id} (kv_transfer_params {params})")
        try:
            saved = load_hidden_states(path)
        finally:
            cleanup_hidden_states(path)
        if saved["token_ids"].tolist() != token_ids:
            raise RuntimeError(f"vLLM's hidden states file {path} holds other tokens than request {output.request_id}")
        hidden = saved["hidden_states"]
        if tuple(hidden.shape) != (len(token_ids), len(self._ids), self.shape.hidden_size):
            raise RuntimeError(
                f"vLLM's hidden states have shape {tuple(hidden.shape)}; expected {(len(token_ids), len(self._ids), self.shape.hidden_size)}"
            )
        return hidden

    # ---------------------------------------------------------------- weights, close
    def update_weights(self, message: UpdateWeights, check_finite: bool, timeout_s: float = 60.0, keys: KeyPair | None = None) -> None:
        """Load the update in place through vLLM's own reload, all or nothing (vllm_updates.py): UpdateRefused,
        UpdateBroken."""
        if self._llm is None:
            raise UpdateRefused("the vllm engine has not started yet (its task prepares it): nothing to update")
        if self._updates is None:
            self._updates = VLLMUpdates(self._llm, self.head.named_weights, self.target, storage_root())
        self._updates.load(message, check_finite, timeout_s, keys)

    def input_embeddings(self) -> torch.Tensor:
        return self.head.embed_tokens.weight.detach()

    def output_embeddings(self) -> torch.Tensor:
        return self.head.lm_head.weight.detach()

    def close(self) -> None:
        self._loss.close()
        if self._nodes is not None:  # first, so that the other nodes stop theirs while this one stops
            self._nodes.close()
        if self._llm is not None:
            self._llm.llm_engine.engine_core.shutdown(timeout=10)
            self._llm = None
        if self._storage is not None:
            shutil.rmtree(self._storage, ignore_errors=True)
            self._storage = None
