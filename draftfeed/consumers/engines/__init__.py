"""Engines that run the frozen target. Each is imported only when chosen."""

from __future__ import annotations

import importlib
from typing import Any

from draftfeed.consumers.engines.base import Engine
from draftfeed.consumers.settings import ENGINES, TargetSettings


def load_engine(settings: TargetSettings, plan: dict[str, Any] | None = None) -> Engine:
    """The engine of ``settings.engine``: ``hf``, ``vllm``, ``sglang``, or ``package.module:Class`` for an engine of
    the user's own, running ``settings.path``.

    Each is built as ``Class(target, device=, dtype=, **engine_options)``; the options are the engine's own settings
    (``--engine-option``), e.g. vLLM's ``gpu_memory_utilization``. ``tensor_parallel`` above 1 spreads the target over
    that many ``devices`` (default: the first ones of ``device``'s kind): vllm by its own ranks, hf, sglang and
    automodel by processes this worker starts (parallel/engine.py). ``device_map="auto"`` (hf only) spreads the layers over
    ``devices`` in this one process instead. With ``nnodes`` above 1 the worker spans machines and this is node 0
    (``plan``: what the other nodes check theirs against; ``devices`` its share). ``pipeline_parallel`` splits the
    layers into stages (refused by each engine, in its words); ``expert_parallel`` shards a mixture of experts' experts
    over the processes. A ValueError says what is wrong in one line.
    """
    name, target, device, dtype, options = settings.engine, settings.path, settings.device, settings.dtype, dict(settings.engine_options)
    tensor_parallel, expert_parallel = settings.tensor_parallel, settings.expert_parallel
    flagged = [key for key in ("target", "device", "dtype") if key in options]
    if flagged:
        raise ValueError(f"--engine-option {', '.join(flagged)}: set {' and '.join('--' + key for key in flagged)} instead")
    nodes = settings.node_plan()
    placed = settings.placed_devices()
    if (problem := settings.placement_problem()) is not None:
        raise ValueError(problem)
    spread: dict[str, Any] = {"nodes": nodes, "plan": plan, "expert_parallel": expert_parallel, "join_timeout_s": settings.join_timeout_s}
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
        if settings.device_map is not None:
            return HFEngine(target, device=placed[0], dtype=dtype, device_map=settings.device_map, devices=placed)
        return HFEngine(target, device=device, dtype=dtype)
    if name == "vllm":
        from draftfeed.consumers.engines.vllm import VLLMEngine

        return VLLMEngine(
            target,
            device=device,
            dtype=dtype,
            tensor_parallel=tensor_parallel,
            devices=placed,
            pipeline_parallel=settings.pipeline_parallel,
            expert_parallel=expert_parallel,
            nodes=nodes,
            plan=plan,
            join_timeout_s=settings.join_timeout_s,
            **options,
        )
    if name == "sglang":
        from draftfeed.consumers.engines.sglang import SGLangEngine

        if tensor_parallel > 1:
            from draftfeed.consumers.engines.parallel.engine import TensorParallelEngine

            return TensorParallelEngine("sglang", target, placed, dtype, options, **spread)
        return SGLangEngine(target, device=device, dtype=dtype, **options)
    if name == "automodel":
        from draftfeed.consumers.engines.automodel import AutoModelEngine

        if tensor_parallel > 1:  # NeMo's own sharding over the processes (automodel_sharding.py)
            from draftfeed.consumers.engines.parallel.engine import TensorParallelEngine

            return TensorParallelEngine("automodel", target, placed, dtype, options, **spread)
        return AutoModelEngine(target, device=device, dtype=dtype, **options)
    if ":" in name:
        module_name, _, class_name = name.partition(":")
        try:
            engine_class = getattr(importlib.import_module(module_name), class_name)
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"--engine {name}: cannot load {class_name} from {module_name}: {exc}") from None
        return engine_class(target, device=device, dtype=dtype, **options)
    raise ValueError(f"unknown engine {name!r}; choose one of {', '.join(ENGINES)}, or give package.module:Class")
