"""Entries of draftfeed's own in transformers' tensor-parallel plans, for the model types whose plan cannot run.

Each is found by a padded batch under the plan failing where one process does not, and written here with its cause
(docs/engines.md, "Frontier architectures"); the worker's start check still refuses any plan that fails.

- ``glm5_next`` (GLM-5.3): the plan shards ``layers.*.self_attn.o_proj`` rowwise, and that name also matches the
  output projection of its linear-attention layers, whose inputs are never split (``RuntimeError: mat1 and mat2 shapes
  cannot be multiplied``). Its attention modules are kept whole on every rank; its experts and MLPs are sharded as
  planned. Measured at degree 2: within 3e-8 of one process on the layers, 3.3e-7 on the logits.
"""

from __future__ import annotations

from typing import Any

REPLICATE = "replicate"  # transformers' style for a module each rank keeps whole

# model type -> (the module path of its decoder layers in the class the hf engine loads it with, modules kept whole)
_WHOLE: dict[str, tuple[str, tuple[str, ...]]] = {
    "glm5_next": (
        "model.language_model.layers.*",
        ("self_attn.q_b_proj", "self_attn.kv_a_proj_with_mqa", "self_attn.kv_b_proj", "self_attn.o_proj"),
    ),
}


def plan_corrections(config: Any) -> dict[str, str]:
    """The tensor-parallel plan entries that replace transformers' own for a target of ``config`` (none for most)."""
    layers, modules = _WHOLE.get(getattr(config, "model_type", ""), ("", ()))
    return {f"{layers}.{module}": REPLICATE for module in modules}


def distributed_config(config: Any, processes: int, expert_parallel: bool = False) -> Any:
    """transformers' ``DistributedConfig`` for a target of ``config`` over ``processes``: its tensor-parallel plan (and
    with ``expert_parallel`` its expert-parallel one, each rank its share of whole experts), with the entries above."""
    from transformers.distributed import DistributedConfig

    sizes = {"tp_size": processes} | ({"ep_size": processes} if expert_parallel else {})
    corrections = plan_corrections(config)
    return DistributedConfig(**sizes, **({"tp_plan": corrections} if corrections else {}))
