"""The engines that run as one rank of a tensor-parallel worker, each built the same way in every process."""

from __future__ import annotations

from typing import Any

from draftfeed.consumers.engines.base import Engine
from draftfeed.consumers.engines.parallel.spec import ProcessPlace

# Engines whose tensor parallelism is draftfeed's: N processes in step (vllm starts its own ranks).
RANKED_ENGINES = ("hf", "sglang", "automodel")


def build_ranked(engine: str, target: str, dtype: str, options: dict[str, Any], place: ProcessPlace, expert_parallel: bool = False) -> Engine:
    """``engine`` as rank ``place.rank`` of its group, on ``place.device``; ``expert_parallel``: a mixture-of-experts
    target's experts sharded over the group (transformers' expert-parallel plan, sglang's ``ep_size``, NeMo's expert
    mesh)."""
    if engine == "hf":
        from draftfeed.consumers.engines.hf import HFEngine

        return HFEngine(target, device=place.device, dtype=dtype, parallel=place, expert_parallel=expert_parallel)
    if engine == "sglang":
        from draftfeed.consumers.engines.sglang import SGLangEngine

        ep = {"ep_size": place.world_size} if expert_parallel else {}
        return SGLangEngine(target, device=place.device, dtype=dtype, parallel=place, **ep, **options)
    if engine == "automodel":
        from draftfeed.consumers.engines.automodel import AutoModelEngine

        return AutoModelEngine(target, device=place.device, dtype=dtype, parallel=place, expert_parallel=expert_parallel, **options)
    raise ValueError(f"--engine {engine} does not run at --tensor-parallel above 1; use {', '.join(RANKED_ENGINES)} or vllm")
