"""The environment vLLM's processes start with (they inherit this process's as vLLM starts them): on CPU each rank's
share of the cores (``VLLM_CPU_OMP_THREADS_BIND``: vLLM refuses several CPU ranks without it), set only while vLLM
starts. Used on node 0 (vllm.py) and on the other nodes of a worker over machines (vllm_nodes.py)."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

log = logging.getLogger("draftfeed.worker")

THREADS_BIND = "VLLM_CPU_OMP_THREADS_BIND"


def core_ranges(cores: Sequence[int]) -> str:
    """Cores as vLLM's CPU list syntax: runs of consecutive ids as "a-b", joined by commas ("0-3,6")."""
    runs: list[list[int]] = []
    for core in cores:
        if runs and core == runs[-1][-1] + 1:
            runs[-1].append(core)
        else:
            runs.append([core])
    return ",".join(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}" for run in runs)


def cpu_thread_binding(tensor_parallel: int, cores: Sequence[int]) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for ``tensor_parallel`` CPU ranks: ``cores`` (sorted) in that many contiguous groups,
    as even as they split ("0|1" on 2 cores, "0-3|4-7" on 8)."""
    if len(cores) < tensor_parallel:
        raise ValueError(
            f"--tensor-parallel {tensor_parallel} on CPU needs a core per rank, and this process may use {len(cores)}; "
            f"lower --tensor-parallel, or set {THREADS_BIND} yourself"
        )
    size, extra = divmod(len(cores), tensor_parallel)
    groups, start = [], 0
    for rank in range(tensor_parallel):
        end = start + size + (rank < extra)
        groups.append(core_ranges(cores[start:end]))
        start = end
    return "|".join(groups)


def cpu_start_environment(tensor_parallel: int) -> dict[str, str]:
    """The variables vLLM's CPU ranks start with: each rank's share of this process's cores in VLLM_CPU_OMP_THREADS_BIND
    (vLLM refuses several CPU ranks without it). Nothing for one rank; a binding the user set is kept."""
    if tensor_parallel == 1:
        return {}
    if THREADS_BIND in os.environ:
        log.info("vllm engine: %s=%s (set by the user) for %d ranks", THREADS_BIND, os.environ[THREADS_BIND], tensor_parallel)
        return {}
    binding = cpu_thread_binding(tensor_parallel, sorted(os.sched_getaffinity(0)))
    log.info("vllm engine: %s=%s, one group of cores per tensor-parallel rank", THREADS_BIND, binding)
    return {THREADS_BIND: binding}


@contextmanager
def environment(variables: dict[str, str]) -> Iterator[None]:
    """``variables`` set in os.environ inside the block (vLLM's processes inherit them as they start), restored after,
    so that a later engine in this process (one rank, another binding) does not inherit them."""
    before = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
