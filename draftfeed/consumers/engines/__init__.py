"""Engines that run the frozen target. Each is imported only when chosen."""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any

from draftfeed.consumers.config import ENGINES
from draftfeed.consumers.devices import placement_problem, tensor_parallel_devices
from draftfeed.consumers.engines.base import Engine
from draftfeed.consumers.nodes import NodePlan


def load_engine(
    name: str,
    target: str,
    device: str,
    dtype: str,
    options: dict[str, Any] | None = None,
    tensor_parallel: int = 1,
    devices: Sequence[str] | None = None,
    device_map: str | None = None,
    *,
    nodes: NodePlan | None = None,
    plan: dict[str, Any] | None = None,
    pipeline_parallel: int = 1,
    expert_parallel: bool = False,
    join_timeout_s: float | None = None,
) -> Engine:
    """``hf``, ``vllm``, ``sglang``, or ``package.module:Class`` for an engine of the user's own.

    Each is built as ``Class(target, device=, dtype=, **options)``; ``options`` are the engine's own
    settings (``--engine-option``), e.g. vLLM's ``gpu_memory_utilization``. ``tensor_parallel`` above 1 spreads
    the target over that many ``devices`` (default: the first ones of ``device``'s kind): vllm by its own
    ranks, hf and sglang by processes this worker starts (parallel/engine.py). ``device_map="auto"`` (hf only)
    spreads the layers over ``devices`` in this one process instead. ``nodes``: the worker spans machines, this is
    node 0 (``plan``: what the other nodes check theirs against), ``devices`` its share. ``pipeline_parallel``
    (vllm) splits the layers into stages; ``expert_parallel`` shards a mixture of experts' experts over the ranks.
    """
    options = options or {}
    flagged = [key for key in ("target", "device", "dtype") if key in options]
    if flagged:
        raise ValueError(f"--engine-option {', '.join(flagged)}: set {' and '.join('--' + key for key in flagged)} instead")
    here = tensor_parallel // (nodes.nnodes if nodes is not None else 1)
    placed = tensor_parallel_devices(device, here, devices) if device_map is None else list(devices or [device])
    if (problem := placement_problem(name, tensor_parallel, device_map, pipeline_parallel, expert_parallel, nodes is not None)) is not None:
        raise ValueError(problem)
    spread: dict[str, Any] = {"nodes": nodes, "plan": plan, "expert_parallel": expert_parallel}
    if join_timeout_s is not None:
        spread["join_timeout_s"] = join_timeout_s
    if name == "hf":
        from draftfeed.consumers.engines.hf import HFEngine, quantization_problem, tensor_parallel_problem

        if options:
            raise ValueError(f"--engine-option {', '.join(options)}: the hf engine takes no options")
        if (problem := quantization_problem(target, placed[0])) is not None:
            raise ValueError(problem)
        if tensor_parallel > 1:
            from draftfeed.consumers.engines.parallel.engine import TensorParallelEngine

            if (problem := tensor_parallel_problem(target, expert_parallel)) is not None:
                raise ValueError(f"--tensor-parallel {tensor_parallel}: {problem}")
            return TensorParallelEngine("hf", target, placed, dtype, **spread)
        if device_map is not None:
            return HFEngine(target, device=placed[0], dtype=dtype, device_map=device_map, devices=placed)
        return HFEngine(target, device=device, dtype=dtype)
    if name == "vllm":
        from draftfeed.consumers.engines.vllm import VLLMEngine

        return VLLMEngine(
            target,
            device=device,
            dtype=dtype,
            tensor_parallel=tensor_parallel,
            devices=devices,
            pipeline_parallel=pipeline_parallel,
            expert_parallel=expert_parallel,
            nodes=nodes,
            **options,
        )
    if name == "sglang":
        from draftfeed.consumers.engines.sglang import SGLangEngine

        if tensor_parallel > 1:
            from draftfeed.consumers.engines.parallel.engine import TensorParallelEngine

            return TensorParallelEngine("sglang", target, placed, dtype, options, **spread)
        return SGLangEngine(target, device=device, dtype=dtype, **options)
    if ":" in name:
        module_name, _, class_name = name.partition(":")
        try:
            engine_class = getattr(importlib.import_module(module_name), class_name)
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"--engine {name}: cannot load {class_name} from {module_name}: {exc}") from None
        return engine_class(target, device=device, dtype=dtype, **options)
    raise ValueError(f"unknown engine {name!r}; choose one of {', '.join(ENGINES)}, or give package.module:Class")
