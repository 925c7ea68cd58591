"""Engines that run the frozen target. Each is imported only when chosen."""

from __future__ import annotations

import importlib
from typing import Any

from draftfeed.consumers.config import ENGINES
from draftfeed.consumers.engines.base import Engine


def load_engine(name: str, target: str, device: str, dtype: str, options: dict[str, Any] | None = None) -> Engine:
    """``hf``, ``vllm``, ``sglang``, or ``package.module:Class`` for an engine of the user's own.

    Each is built as ``Class(target, device=, dtype=, **options)``; ``options`` are the engine's own
    settings (``--engine-option``), e.g. vLLM's ``gpu_memory_utilization``.
    """
    options = options or {}
    flagged = [key for key in ("target", "device", "dtype") if key in options]
    if flagged:
        raise ValueError(f"--engine-option {', '.join(flagged)}: set {' and '.join('--' + key for key in flagged)} instead")
    if name == "hf":
        from draftfeed.consumers.engines.hf import HFEngine

        if options:
            raise ValueError(f"--engine-option {', '.join(options)}: the hf engine takes no options")
        return HFEngine(target, device=device, dtype=dtype)
    if name == "vllm":
        from draftfeed.consumers.engines.vllm import VLLMEngine

        return VLLMEngine(target, device=device, dtype=dtype, **options)
    if name == "sglang":
        from draftfeed.consumers.engines.sglang import SGLangEngine

        return SGLangEngine(target, device=device, dtype=dtype, **options)
    if ":" in name:
        module_name, _, class_name = name.partition(":")
        try:
            engine_class = getattr(importlib.import_module(module_name), class_name)
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"--engine {name}: cannot load {class_name} from {module_name}: {exc}") from None
        return engine_class(target, device=device, dtype=dtype, **options)
    raise ValueError(f"unknown engine {name!r}; choose one of {', '.join(ENGINES)}, or give package.module:Class")
