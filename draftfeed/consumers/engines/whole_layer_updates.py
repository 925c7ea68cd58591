"""Weight updates for an engine that loads them itself, under the checkpoint's own names (vllm, automodel), rather
than copying into tensors of those names (hf: consumers/weight_updates.py).

Such an engine holds the tensors in a layout of its own (vLLM fuses q, k and v, gate and up; NeMo stacks the experts),
so an update is checked against the checkpoint's names, shapes and dtypes, read from its files' headers, and it must
hold every tensor of each decoder layer it changes, or none: a part of a layer would leave the rest of its fused or
stacked tensor unset. A file update is checked one tensor at a time; a published one is pulled, whole, into memory the
engine lays out (``lay_out``), then handed to it: a pull that breaks off has written only that memory, so the engine
keeps its version (UpdateRefused, not UpdateBroken).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from draftfeed.consumers.weight_updates import update_files, update_problem
from draftfeed.dataplane.frames.codec import DTYPES
from draftfeed.dataplane.weights.worker import UpdateBroken, UpdateRefused, pull_keys, pull_update
from draftfeed.schemas.messages import TensorSpec, UpdateWeights
from draftfeed.security.keys import KeyPair

# safetensors' names of the dtypes an update may hold
SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
LAYER = re.compile(r"^((?:.*\.)?layers\.\d+)\.")  # model.layers.3.mlp..., layers.3.attn... (NeMo's own checkpoints)
Loader = Callable[[], torch.Tensor]  # a checked tensor of an update, read when asked for


def checkpoint_tensors(target: str) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors as meta tensors (name, shape, dtype: no data), from its safetensors files' headers."""
    from safetensors import safe_open

    by_name = {short: dtype for dtype, short in SAFETENSORS_DTYPES.items()}
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(Path(target).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                part = handle.get_slice(name)
                tensors[name] = torch.empty(part.get_shape(), dtype=by_name[part.get_dtype()], device="meta")
    return tensors


def layer_problem(engine: str, names: list[str], checkpoint: Mapping[str, torch.Tensor]) -> str | None:
    """Why ``engine`` cannot load ``names`` alone (a decoder layer given in part, named with what is missing), or None."""
    given = set(names)
    for name in names:
        match = LAYER.match(name)
        if match is None:
            continue
        missing = sorted(other for other in checkpoint if other.startswith(match.group(1) + ".") and other not in given)
        if missing:
            more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
            return (
                f"tensor {name}: engine {engine} loads an update a decoder layer at a time (it fuses or stacks tensors), "
                f"and {missing[0]}{more} of {match.group(1)} are not in it: give every tensor of each layer the update changes"
            )
    return None


def checked_files(engine: str, weights: str, checkpoint: Mapping[str, torch.Tensor], check_finite: bool) -> tuple[list[Path], dict[str, Loader]]:
    """A file update's files and a loader of each of its tensors, once every tensor passed the checks (read one at a
    time, so the check holds one tensor at most); UpdateRefused in one line naming the first that did not."""
    from safetensors import safe_open

    files = update_files(weights)
    tensors: dict[str, Loader] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as handle:
                for name in handle.keys():
                    if (problem := update_problem(checkpoint, {name: handle.get_tensor(name)}, check_finite)) is not None:
                        raise UpdateRefused(problem)
                    tensors[name] = lambda file=file, name=name: _read(file, name)
        except UpdateRefused:
            raise
        except Exception as exc:  # a truncated or foreign file: say which
            raise UpdateRefused(f"weights {file}: not a readable safetensors file ({type(exc).__name__}: {exc})") from None
    if not tensors:
        raise UpdateRefused(f"weights {weights}: the files hold no tensors")
    if (problem := layer_problem(engine, list(tensors), checkpoint)) is not None:
        raise UpdateRefused(problem)
    return files, tensors


def pulled(
    engine: str,
    message: UpdateWeights,
    checkpoint: Mapping[str, torch.Tensor],
    lay_out: Callable[[list[TensorSpec]], list[torch.Tensor]],
    check_finite: bool,
    timeout_s: float,
    keys: KeyPair | None,
) -> dict[str, Loader]:
    """A published update pulled whole into the tensors ``lay_out`` makes for its manifest, once checked; a loader of
    each (a copy of its bytes as its dtype and shape)."""
    loaders: dict[str, Loader] = {}

    def into(specs: list[TensorSpec]) -> list[torch.Tensor]:
        if (problem := layer_problem(engine, [spec.name for spec in specs], checkpoint)) is not None:
            raise UpdateRefused(problem)
        held = lay_out(specs)
        for spec, tensor in zip(specs, held, strict=True):
            loaders[spec.name] = lambda tensor=tensor, spec=spec: _typed(tensor, spec)
        return held

    try:
        pull_update(message.source or "", message.update, checkpoint, check_finite, timeout_s, pull_keys(message.source_key, keys), into=into)
    except UpdateBroken as exc:  # only the engine's staging was written: the engine is untouched
        raise UpdateRefused(str(exc).split("; ")[0]) from None
    return loaders


def _typed(held: torch.Tensor, spec: TensorSpec) -> torch.Tensor:
    dtype = DTYPES[spec.dtype]
    if held.dtype == dtype:
        return held.view(spec.shape)
    return held.clone().view(dtype).view(spec.shape)  # bytes laid out unaligned (a safetensors file): copied first


def _read(file: Path, name: str) -> torch.Tensor:
    from safetensors import safe_open

    with safe_open(str(file), framework="pt") as handle:
        return handle.get_tensor(name)
