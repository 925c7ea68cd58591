"""Tasks: which supervision a worker computes from its engine's forward."""

from __future__ import annotations

from typing import get_args

from draftfeed.consumers.config import DEFAULT_DRAFT_LAYERS
from draftfeed.consumers.engines.base import Engine
from draftfeed.consumers.tasks.base import Task
from draftfeed.consumers.tasks.dspark import DSparkTask
from draftfeed.consumers.tasks.eagle3 import Eagle3Task
from draftfeed.schemas.messages import DEFAULT_SUPERVISION, TaskName

TASKS = get_args(TaskName)


def load_task(
    name: str,
    engine: Engine,
    layer_ids: list[int] | None = None,
    draft_layers: int = DEFAULT_DRAFT_LAYERS,
    supervision: str = DEFAULT_SUPERVISION,
    chunk_tokens: int = 0,
) -> Task:
    """``eagle3`` (layer_ids: the 3 aux layers; supervision: its form; chunk_tokens: see Eagle3Task) or ``dspark``
    (layer_ids: the target layers; it has no vocab-sized step to chunk)."""
    if name == "eagle3":
        return Eagle3Task(engine, layer_ids, supervision, chunk_tokens)  # type: ignore[arg-type]
    if name == "dspark":
        return DSparkTask(engine, layer_ids, draft_layers)
    raise ValueError(f"unknown task {name!r}; choose one of {', '.join(TASKS)}")
