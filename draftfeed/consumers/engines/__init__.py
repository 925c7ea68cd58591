"""Engines that run the frozen target. Each is imported only when chosen."""

from __future__ import annotations

from draftfeed.consumers.engines.base import Engine

ENGINES = ("hf",)


def load_engine(name: str, target: str, device: str, dtype: str) -> Engine:
    if name == "hf":
        from draftfeed.consumers.engines.hf import HFEngine

        return HFEngine(target, device=device, dtype=dtype)
    raise ValueError(f"unknown engine {name!r}; choose one of {', '.join(ENGINES)}")
