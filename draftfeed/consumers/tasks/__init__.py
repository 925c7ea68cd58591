"""Tasks: which supervision a worker computes from its engine's forward."""

from __future__ import annotations

from draftfeed.consumers.config import DEFAULT_DRAFT_LAYERS, task_settings_problem
from draftfeed.consumers.engines.base import Engine
from draftfeed.consumers.tasks.base import Task
from draftfeed.consumers.tasks.dflash import DFlashTask
from draftfeed.consumers.tasks.dspark import DSparkTask
from draftfeed.consumers.tasks.eagle import EagleTask
from draftfeed.consumers.tasks.eagle3 import Eagle3Task
from draftfeed.consumers.tasks.vispec import VispecTask
from draftfeed.schemas.messages import TASKS, default_supervision


def load_task(
    name: str,
    engine: Engine,
    layer_ids: list[int] | None = None,
    draft_layers: int = DEFAULT_DRAFT_LAYERS,
    supervision: str | None = None,
    chunk_tokens: int = 0,
    capture_logits: bool = False,
    image_token_id: int | None = None,
) -> Task:
    """The task ``name`` on ``engine``: layer_ids are EAGLE-3's 3 aux layers or DSpark's and DFlash's target layers
    (None: the task's default, from draft_layers for the last two); supervision is one of the task's forms (None: its
    first); chunk_tokens bounds EAGLE-3's vocab-sized step; capture_logits makes DFlash send logits (JetSpec);
    image_token_id is ViSpec's image placeholder. A ValueError says what is wrong in one line."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; choose one of {', '.join(TASKS)}")
    if (problem := task_settings_problem(name, supervision, capture_logits)) is not None:
        raise ValueError(problem)
    form = supervision or default_supervision(name)  # type: ignore[arg-type]
    if name == "eagle3":
        return Eagle3Task(engine, layer_ids, form, chunk_tokens)  # type: ignore[arg-type]
    if name == "dspark":
        return DSparkTask(engine, layer_ids, draft_layers)
    if name == "dflash":
        return DFlashTask(engine, layer_ids, draft_layers, capture_logits, form)  # type: ignore[arg-type]
    if name == "eagle":
        return EagleTask(engine, form)  # type: ignore[arg-type]
    if image_token_id is None:
        raise ValueError("--task vispec needs the target's image token id (its config's image_token_id)")
    return VispecTask(engine, image_token_id, form)  # type: ignore[arg-type]
