"""Tasks: which supervision a worker computes from its engine's forward."""

from __future__ import annotations

from draftfeed.consumers.engines.base import Engine
from draftfeed.consumers.settings import TaskSettings
from draftfeed.consumers.tasks.base import Task
from draftfeed.consumers.tasks.dflash import DFlashTask
from draftfeed.consumers.tasks.dspark import DSparkTask
from draftfeed.consumers.tasks.eagle import EagleTask
from draftfeed.consumers.tasks.eagle3 import Eagle3Task
from draftfeed.consumers.tasks.vispec import VispecTask
from draftfeed.schemas.messages import default_supervision


def load_task(settings: TaskSettings, engine: Engine) -> Task:
    """The task of ``settings`` on ``engine``: its layer ids are EAGLE-3's 3 aux layers or DSpark's and DFlash's
    target layers (None: the task's default, from draft_layers for the last two); its supervision one of the task's
    forms (None: its first); chunk_tokens bounds EAGLE-3's vocab-sized step; capture_logits makes DFlash send logits
    (JetSpec); image_token_id is ViSpec's image placeholder (the target config's). A ValueError says
    what is wrong in one line."""
    if (problem := settings.problem()) is not None:
        raise ValueError(problem)
    name, form, layer_ids = settings.name, settings.supervision or default_supervision(settings.name), settings.layer_ids
    if name == "eagle3":
        return Eagle3Task(engine, layer_ids, form, settings.chunk_tokens)  # type: ignore[arg-type]
    if name == "dspark":
        return DSparkTask(engine, layer_ids, settings.draft_layers)
    if name == "dflash":
        return DFlashTask(engine, layer_ids, settings.draft_layers, settings.capture_logits, form)  # type: ignore[arg-type]
    if name == "eagle":
        return EagleTask(engine, form)  # type: ignore[arg-type]
    if settings.image_token_id is None:
        raise ValueError("--task vispec needs the target's image token id (its config's image_token_id)")
    return VispecTask(engine, settings.image_token_id, form)  # type: ignore[arg-type]
