"""Engines that run the frozen target. Each is imported only when chosen."""

from __future__ import annotations

import importlib

from draftfeed.consumers.engines.base import Engine

ENGINES = ("hf",)


def load_engine(name: str, target: str, device: str, dtype: str) -> Engine:
    """``hf``, or ``package.module:Class`` for an engine of the user's own, built as ``Class(target, device=, dtype=)``."""
    if name == "hf":
        from draftfeed.consumers.engines.hf import HFEngine

        return HFEngine(target, device=device, dtype=dtype)
    if ":" in name:
        module_name, _, class_name = name.partition(":")
        try:
            engine_class = getattr(importlib.import_module(module_name), class_name)
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"--engine {name}: cannot load {class_name} from {module_name}: {exc}") from None
        return engine_class(target, device=device, dtype=dtype)
    raise ValueError(f"unknown engine {name!r}; choose one of {', '.join(ENGINES)}, or give package.module:Class")
