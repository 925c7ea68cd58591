"""The automodel engine over a worker's processes (``--tensor-parallel N``): NeMo AutoModel's own sharding of its
model, as its frontier DSpark recipes shard their targets (``ep_size`` and FSDP, never tensor parallelism).

- NeMo's device mesh (``create_distributed_setup_from_config``, strategy ``fsdp2``) over the worker's process group:
  FSDP over all N processes, and with ``--expert-parallel`` an expert-parallel axis of N (each rank its share of whole
  experts; the rest FSDP-sharded). Parameters stay in the engine's dtype (a mixed-precision policy of that dtype), and
  FSDP frees each layer's gathered weights after its forward, so a rank holds its shard and one layer at a time.
- NeMo's model class built with its parameters on the meta device, as NeMo builds it (``init_empty_weights``), sharded
  by NeMo's parallelizer (``parallelize_model``), then each rank's shards given memory on its device.
- The checkpoint read one decoder layer at a time (``layer_groups``), mapped by the model's own ``state_dict_adapter``
  (told the expert mesh, so each rank maps its own experts only), each rank copying its shard (``copy_into``).

Every rank computes the same batch (the worker's ranks run in step): attention runs whole on every rank, and NeMo's
torch dispatcher gathers the ranks' tokens for the experts. Nothing here is draftfeed's arithmetic: the forward is
NeMo's sharded model.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

# The decoder layer a checkpoint name belongs to; names outside every layer (embeddings, final norm, head) load last.
LAYER_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def mesh_context(world_size: int, expert_parallel: bool, dtype: torch.dtype) -> Any:
    """NeMo's mesh over this process group: FSDP over ``world_size`` ranks, experts over as many with
    ``expert_parallel``; parameters computed in ``dtype`` and resharded after each layer's forward."""
    from nemo_automodel.recipes._dist_utils import create_distributed_setup_from_config
    from torch.distributed.fsdp import MixedPrecisionPolicy

    setup = create_distributed_setup_from_config(
        strategy="fsdp2",
        world_size=world_size,
        ep_size=world_size if expert_parallel else 1,
        mp_policy=MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype),
        reshard_after_forward=True,
        moe={"reshard_after_forward": True},
    )
    return setup.mesh_context


def sharded_model(build: Any, mesh: Any, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """``build()`` (NeMo's class, constructed on ``device``) with its parameters on the meta device (NeMo's own
    ``init_empty_weights``: the buffers and rotary tables it computes are real), sharded by NeMo's parallelizer, then
    each rank's shards given memory on ``device`` in ``dtype``, still to be loaded; floating buffers in ``dtype`` too, as
    ``Module.to(dtype)`` leaves them in one process."""
    from nemo_automodel.components.checkpoint.checkpointing import to_empty_parameters_only
    from nemo_automodel.components.distributed.model_parallelizer import parallelize_model
    from nemo_automodel.components.utils.model_utils import init_empty_weights

    with init_empty_weights():
        model = build()
    model = parallelize_model(model, mesh) or model
    to_empty_parameters_only(model, device=device, dtype=dtype)
    for module in model.modules():
        for name, buffer in module._buffers.items():
            if buffer is not None and buffer.is_floating_point():
                module._buffers[name] = buffer.to(device=device, dtype=dtype)
    return model


def checkpoint_files(target: str) -> list[Path]:
    """The checkpoint's safetensors files, or a ValueError in one line if it has none."""
    files = sorted(Path(target).glob("*.safetensors"))
    if not files:
        raise ValueError(f"--target {target}: no .safetensors files there; the automodel engine reads safetensors checkpoints")
    return files


def layer_groups(target: str) -> Iterator[dict[str, torch.Tensor]]:
    """The checkpoint's tensors, one decoder layer at a time in order, then those outside every layer."""
    from safetensors import safe_open

    where: dict[int | None, list[tuple[Path, str]]] = {}
    for file in checkpoint_files(target):
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                found = LAYER_NAME.search(name)
                where.setdefault(int(found.group(1)) if found else None, []).append((file, name))
    for layer in sorted(key for key in where if key is not None) + ([None] if None in where else []):
        group: dict[str, torch.Tensor] = {}
        for file in sorted({file for file, _ in where[layer]}):
            with safe_open(str(file), framework="pt") as handle:
                group |= {name: handle.get_tensor(name) for f, name in where[layer] if f == file}
        yield group


def map_group(adapter: Any, group: dict[str, torch.Tensor], moe_mesh: Any) -> dict[str, torch.Tensor]:
    """One group under NeMo's names, by the model's own adapter; told the expert mesh where it takes one."""
    if adapter is None:
        return group
    if moe_mesh is not None and "device_mesh" in inspect.signature(adapter.from_hf).parameters:
        return adapter.from_hf(group, device_mesh=moe_mesh)
    return adapter.from_hf(group)


def copy_into(held: dict[str, torch.Tensor], mapped: dict[str, torch.Tensor]) -> None:
    """Copy each mapped tensor into the model's own (``held``, its state dict): a sharded one (DTensor) keeps this
    rank's shard of it. Every rank calls this in step (a tensor mapped under other placements is gathered first)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    for name, tensor in mapped.items():
        mine = held[name]
        if not isinstance(mine, DTensor):
            mine.copy_(tensor.full_tensor() if isinstance(tensor, DTensor) else tensor)
            continue
        if isinstance(tensor, DTensor) and tensor.device_mesh == mine.device_mesh and tensor.placements == mine.placements:
            mine.to_local().copy_(tensor.to_local())
            continue
        whole = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        mine.to_local().copy_(distribute_tensor(whole.to(mine.device), mine.device_mesh, mine.placements, src_data_rank=None).to_local())


def mismatch(held: dict[str, torch.Tensor], mapped: dict[str, torch.Tensor]) -> str | None:
    """The first mapped tensor the model has not, or has in another shape (whole shapes compared), or None."""
    for name, tensor in mapped.items():
        if name not in held or tuple(held[name].shape) != tuple(tensor.shape):
            found = "no such tensor" if name not in held else f"shape {list(held[name].shape)}"
            return f"tensor {name} (NeMo's name for it): shape {list(tensor.shape)} given, NeMo's model has {found}"
    return None


def load_sharded(model: nn.Module, target: str, moe_mesh: Any) -> None:
    """The checkpoint into ``model``'s shards, a decoder layer at a time; a tensor that does not fit, or one the
    checkpoint lacks, is one ValueError naming it."""
    held = model.state_dict()
    adapter = getattr(model, "state_dict_adapter", None)
    loaded: set[str] = set()
    for group in layer_groups(target):
        mapped = map_group(adapter, group, moe_mesh)
        if (problem := mismatch(held, mapped)) is not None:
            raise ValueError(f"--target {target}: its weights do not fit NeMo's {type(model).__name__}: {problem}")
        copy_into(held, mapped)
        loaded |= set(mapped)
    missing = sorted(set(held) - loaded)
    if missing:
        raise ValueError(f"--target {target}: its weights do not fit NeMo's {type(model).__name__}: {len(missing)} missing (first {missing[:3]})")


def settle(model: nn.Module, device: torch.device) -> None:
    """One forward of two tokens, outside inference mode, on every rank in step. FSDP sets its shards up at a model's
    first forward; under inference mode a rank whose shard is padded (a tensor of fewer rows than ranks, DeepSeek-V4.1's
    hyper-connection scales) would get inference tensors there, which a later weight update cannot copy into."""
    tokens = torch.zeros(1, 2, dtype=torch.long, device=device)
    with torch.no_grad():
        model(input_ids=tokens, attention_mask=torch.ones_like(tokens))
    release_gathered(model)


def release_gathered(model: nn.Module) -> None:
    """Free what FSDP still holds gathered after a forward: its root unit (the final norm and lm_head under FSDP alone)
    stays whole after a forward, for the backward a training step would run next; a worker runs none."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        model.reshard()
