"""Which devices the processes of one tensor-parallel worker run on (pure: no torch, no processes)."""

from __future__ import annotations

import re
from collections.abc import Sequence

_DEVICE = re.compile(r"^(cpu|cuda|xpu)(:(\d+))?$")


def tensor_parallel_devices(device: str, tensor_parallel: int, devices: Sequence[str] | None = None) -> list[str]:
    """One device per process, rank 0 (the worker's own process) first.

    ``devices`` when given (their number must be ``tensor_parallel``); else ``tensor_parallel`` devices of
    ``device``'s type: on CPU all ``cpu``, on an accelerator the visible ones from ``device``'s index on (``cuda``
    or ``cuda:0`` with 4: ``cuda:0`` to ``cuda:3``). Raises ValueError naming the flag to change.
    """
    if tensor_parallel < 1:
        raise ValueError(f"--tensor-parallel {tensor_parallel}: give the number of devices one worker spreads its target over, at least 1")
    if devices:
        devices = [d.strip() for d in devices]
        if len(devices) != tensor_parallel:
            raise ValueError(
                f"--devices names {len(devices)} devices ({','.join(devices)}) for --tensor-parallel {tensor_parallel}: name one per process"
            )
        for item in devices:
            if not _DEVICE.match(item):
                raise ValueError(f"--devices: {item!r} is not a device; write cpu, or cuda:INDEX like cuda:0,cuda:1")
        kinds = {d.split(":")[0] for d in devices}
        if len(kinds) > 1:
            raise ValueError(f"--devices {','.join(devices)}: every process of one worker runs on the same kind of device")
        accelerators = [d for d in devices if d != "cpu"]
        if any(":" not in d for d in accelerators):
            raise ValueError(f"--devices {','.join(devices)}: give each accelerator's index, like cuda:0,cuda:1")
        if len(set(accelerators)) != len(accelerators):
            raise ValueError(f"--devices {','.join(devices)}: a device is named twice; each process needs a device of its own")
        return devices
    match = _DEVICE.match(device)
    if match is None:
        raise ValueError(f"--device {device!r} is not a device; write cpu or cuda:INDEX")
    kind, index = match.group(1), int(match.group(3) or 0)
    if kind == "cpu":
        return ["cpu"] * tensor_parallel
    return [f"{kind}:{index + rank}" for rank in range(tensor_parallel)]


# Why an engine does not run a target's layers in pipeline stages (--pipeline-parallel), by engine.
NO_PIPELINE = {
    "hf": "the hf engine spreads a target by tensor parallelism (--tensor-parallel N, over machines with --nnodes) or its layers "
    "over one process's devices (--device-map auto); for pipeline stages serve it with --engine vllm",
    "sglang": "the sglang engine drives sglang's ModelRunner at pp_size 1 (it captures every layer on one stage); spread the target "
    "with --tensor-parallel N, over machines with --nnodes",
    "vllm": "vLLM's extract_hidden_states capture refuses pipeline parallelism (vLLM 0.32: 'Pipeline parallelism is not supported for "
    "this model. Supported models implement the SupportsPP interface': its capture's draft model does not); spread the target "
    "with --tensor-parallel N",
}


def placement_problem(
    engine: str, tensor_parallel: int, device_map: str | None, pipeline_parallel: int = 1, expert_parallel: bool = False, nodes: bool = False
) -> str | None:
    """Why ``--engine``, ``--tensor-parallel``, ``--device-map``, ``--pipeline-parallel``, ``--expert-parallel`` and
    ``--nnodes`` do not go together, or None."""
    if pipeline_parallel < 1:
        return f"--pipeline-parallel {pipeline_parallel}: give the number of pipeline stages, at least 1"
    if pipeline_parallel > 1 and engine in NO_PIPELINE:
        return f"--pipeline-parallel {pipeline_parallel}: {NO_PIPELINE[engine]}"
    if expert_parallel and tensor_parallel * pipeline_parallel < 2:
        return "--expert-parallel shards the experts over the worker's processes: give --tensor-parallel N (2 or more) with it"
    if nodes and ":" in engine:
        return f"--engine {engine}: an engine of your own runs on one machine; --nnodes is for hf, sglang, vllm and automodel"
    if nodes and device_map is not None:
        return "--device-map auto spreads layers over one machine's devices; across machines use --tensor-parallel N with --nnodes"
    if device_map is not None and engine != "hf":
        return f"--device-map is the hf engine's; --engine {engine} spreads a target with --tensor-parallel N"
    if device_map is not None and tensor_parallel > 1:
        return "--device-map and --tensor-parallel exclude each other: shard each layer (--tensor-parallel) or spread the layers (--device-map)"
    if tensor_parallel > 1 and ":" in engine:
        return f"--engine {engine}: an engine of your own runs at --tensor-parallel 1; spread the target inside it"
    return None
