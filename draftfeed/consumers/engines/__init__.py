"""Engines that run the frozen target. Each is imported only when chosen."""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any

from draftfeed.consumers.config import ENGINES
from draftfeed.consumers.devices import placement_problem, tensor_parallel_devices
from draftfeed.consumers.engines.base import Engine


def load_engine(
    name: str,
    target: str,
    device: str,
    dtype: str,
    options: dict[str, Any] | None = None,
    tensor_parallel: int = 1,
    devices: Sequence[str] | None = None,
    device_map: str | None = None,
) -> Engine:
    """``hf``, ``vllm``, ``sglang``, or ``package.module:Class`` for an engine of the user's own.

    Each is built as ``Class(target, device=, dtype=, **options)``; ``options`` are the engine's own
    settings (``--engine-option``), e.g. vLLM's ``gpu_memory_utilization``. ``tensor_parallel`` above 1 spreads
    the target over that many ``devices`` (default: the first ones of ``device``'s kind): vllm by its own
    ranks, hf and sglang by processes this worker starts (parallel/engine.py). ``device_map="auto"`` (hf only)
    spreads the layers over ``devices`` in this one process instead.
    """
    options = options or {}
    flagged = [key for key in ("target", "device", "dtype") if key in options]
    if flagged:
        raise ValueError(f"--engine-option {', '.join(flagged)}: set {' and '.join('--' + key for key in flagged)} instead")
    placed = tensor_parallel_devices(device, tensor_parallel, devices) if device_map is None else list(devices or [device])
    if (problem := placement_problem(name, tensor_parallel, device_map)) is not None:
        raise ValueError(problem)
    if name == "hf":
        from draftfeed.consumers.engines.hf import HFEngine, tensor_parallel_problem

        if options:
            raise ValueError(f"--engine-option {', '.join(options)}: the hf engine takes no options")
        if tensor_parallel > 1:
            from draftfeed.consumers.engines.parallel.engine import TensorParallelEngine

            if (problem := tensor_parallel_problem(target)) is not None:
                raise ValueError(f"--tensor-parallel {tensor_parallel}: {problem}")
            return TensorParallelEngine("hf", target, placed, dtype)
        if device_map is not None:
            return HFEngine(target, device=placed[0], dtype=dtype, device_map=device_map, devices=placed)
        return HFEngine(target, device=device, dtype=dtype)
    if name == "vllm":
        from draftfeed.consumers.engines.vllm import VLLMEngine

        return VLLMEngine(target, device=device, dtype=dtype, tensor_parallel=tensor_parallel, devices=devices, **options)
    if name == "sglang":
        from draftfeed.consumers.engines.sglang import SGLangEngine

        if tensor_parallel > 1:
            from draftfeed.consumers.engines.parallel.engine import TensorParallelEngine

            return TensorParallelEngine("sglang", target, placed, dtype, options)
        return SGLangEngine(target, device=device, dtype=dtype, **options)
    if ":" in name:
        module_name, _, class_name = name.partition(":")
        try:
            engine_class = getattr(importlib.import_module(module_name), class_name)
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"--engine {name}: cannot load {class_name} from {module_name}: {exc}") from None
        return engine_class(target, device=device, dtype=dtype, **options)
    raise ValueError(f"unknown engine {name!r}; choose one of {', '.join(ENGINES)}, or give package.module:Class")
