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


def placement_problem(engine: str, tensor_parallel: int, device_map: str | None) -> str | None:
    """Why ``--engine``, ``--tensor-parallel`` and ``--device-map`` do not go together, or None."""
    if device_map is not None and engine != "hf":
        return f"--device-map is the hf engine's; --engine {engine} spreads a target with --tensor-parallel N"
    if device_map is not None and tensor_parallel > 1:
        return "--device-map and --tensor-parallel exclude each other: shard each layer (--tensor-parallel) or spread the layers (--device-map)"
    if tensor_parallel > 1 and ":" in engine:
        return f"--engine {engine}: an engine of your own runs at --tensor-parallel 1; spread the target inside it"
    return None
