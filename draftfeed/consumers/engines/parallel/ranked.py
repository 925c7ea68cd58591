"""The engines that run as one rank of a tensor-parallel worker, each built the same way in every process."""

from __future__ import annotations

from typing import Any

from draftfeed.consumers.engines.base import Engine
from draftfeed.consumers.engines.parallel.spec import ParallelRank

# Engines whose tensor parallelism is draftfeed's: N processes in step (vllm starts its own ranks).
RANKED_ENGINES = ("hf", "sglang")


def build_ranked(engine: str, target: str, dtype: str, options: dict[str, Any], place: ParallelRank) -> Engine:
    """``engine`` as rank ``place.rank`` of its group, on ``place.device``."""
    if engine == "hf":
        from draftfeed.consumers.engines.hf import HFEngine

        return HFEngine(target, device=place.device, dtype=dtype, parallel=place)
    if engine == "sglang":
        from draftfeed.consumers.engines.sglang import SGLangEngine

        return SGLangEngine(target, device=place.device, dtype=dtype, parallel=place, **options)
    raise ValueError(f"--engine {engine} does not run at --tensor-parallel above 1; use {', '.join(RANKED_ENGINES)} or vllm")
