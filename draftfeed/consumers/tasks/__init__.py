"""Tasks: which supervision a worker computes from its engine's forward."""

from __future__ import annotations

from draftfeed.consumers.engines.base import Engine
from draftfeed.consumers.tasks.dspark import DEFAULT_DRAFT_LAYERS, DSparkTask
from draftfeed.consumers.tasks.eagle3 import Eagle3Task

TASKS = ("eagle3", "dspark")


def load_task(
    name: str, engine: Engine, layer_ids: list[int] | None = None, draft_layers: int = DEFAULT_DRAFT_LAYERS, supervision: str = "probs"
) -> Eagle3Task | DSparkTask:
    """``eagle3`` (layer_ids: the 3 aux layers; supervision: its form) or ``dspark`` (layer_ids: the target layers)."""
    if name == "eagle3":
        return Eagle3Task(engine, layer_ids, supervision)  # type: ignore[arg-type]
    if name == "dspark":
        return DSparkTask(engine, layer_ids, draft_layers)
    raise ValueError(f"unknown task {name!r}; choose one of {', '.join(TASKS)}")
