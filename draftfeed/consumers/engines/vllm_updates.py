"""Weight updates in place on the vllm engine (docs/versions.md).

vLLM loads an update itself, through its own in-place reload (``reload_weights`` on every rank, from a folder of
safetensors files): each rank reads and shards the tensors, and vLLM runs its processing after loading again (on CPU
the GEMM weights it repacks). The engine's own ends of the target (TargetHead: embeddings, final norm, lm_head) take
theirs here. So an update reaches vLLM as a folder: a file update's files (linked, after the checks), a published
update pulled straight into one safetensors file in memory (/dev/shm), laid out from its manifest before the first
piece comes. A pull that breaks off has written only that file: the engine keeps its version.

The checks are those of every update, against the checkpoint's own names, shapes and dtypes (read from its files'
headers: vLLM holds the tensors in its own, fused, layout), plus one of vLLM's: it loads a decoder layer at a time and
fuses projections (q, k, v; gate and up; the experts), so an update holds every tensor of each decoder layer it
changes, or none (one of them alone would leave the rest of its fused tensor unset).
"""

from __future__ import annotations

import json
import re
import shutil
import struct
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from draftfeed.dataplane.frames.codec import DTYPES
from draftfeed.dataplane.weights.worker import UpdateBroken, UpdateRefused, pull_keys, pull_update, tensor_problem
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
LAYER = re.compile(r"^(.*\.layers\.\d+)\.")


def checkpoint_tensors(target: str) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors as meta tensors (name, shape, dtype: no data), from its safetensors files' headers."""
    from safetensors import safe_open

    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(Path(target).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                part = handle.get_slice(name)
                dtype = next(torch_dtype for torch_dtype, short in SAFETENSORS_DTYPES.items() if short == part.get_dtype())
                tensors[name] = torch.empty(part.get_shape(), dtype=dtype, device="meta")
    return tensors


def layer_problem(names: list[str], checkpoint: Mapping[str, torch.Tensor]) -> str | None:
    """Why vLLM cannot load ``names`` alone (a decoder layer given in part, named), or None."""
    given = set(names)
    for name in names:
        match = LAYER.match(name)
        if match is None:
            continue
        missing = sorted(other for other in checkpoint if other.startswith(match.group(1) + ".") and other not in given)
        if missing:
            more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
            return (
                f"tensor {name}: engine vllm loads an update a decoder layer at a time (it fuses projections), and "
                f"{missing[0]}{more} of {match.group(1)} are not in it: give every tensor of each layer the update changes"
            )
    return None


class VLLMUpdates:
    """Loads updates into a running ``vllm.LLM`` and the engine's TargetHead, all or nothing."""

    def __init__(self, llm: Any, head_weights: Callable[[], dict[str, torch.Tensor]], target: str, storage: str | None) -> None:
        self.llm, self.head_weights, self.storage = llm, head_weights, storage
        self.checkpoint = checkpoint_tensors(target)

    def load(self, message: UpdateWeights, check_finite: bool, timeout_s: float, keys: KeyPair | None) -> None:
        """UpdateRefused when the engine is untouched; UpdateBroken when vLLM failed partway through its reload."""
        folder = Path(tempfile.mkdtemp(prefix="draftfeed-vllm-update-", dir=self.storage))
        try:
            if message.source is None:
                tensors = self._linked(message.weights or "", folder, check_finite)
            else:
                tensors = self._pulled(message, folder, check_finite, timeout_s, keys)
            try:
                self.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(folder), "is_checkpoint_format": True})
            except Exception as exc:  # vLLM's ranks may hold part of it
                raise UpdateBroken(f"vLLM's reload failed: {type(exc).__name__}: {exc}") from None
            head = self.head_weights()
            for name in tensors.keys() & head.keys():
                head[name].copy_(tensors[name]())
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def _linked(self, weights: str, folder: Path, check_finite: bool) -> dict[str, Callable[[], torch.Tensor]]:
        """A file update's files linked into ``folder`` once every tensor passed the checks (read one at a time)."""
        from safetensors import safe_open

        where = Path(weights)
        files = sorted(where.glob("*.safetensors")) if where.is_dir() else [where] if where.is_file() else []
        if not files:
            raise UpdateRefused(
                f"weights {weights}: no safetensors file there (give a .safetensors file or a folder of them, on the worker's filesystem)"
            )
        tensors: dict[str, Callable[[], torch.Tensor]] = {}
        for number, file in enumerate(files):
            try:
                with safe_open(str(file), framework="pt") as handle:
                    for name in handle.keys():
                        tensor = handle.get_tensor(name)
                        if (problem := tensor_problem(self.checkpoint, name, list(tensor.shape), tensor.dtype)) is not None:
                            raise UpdateRefused(problem)
                        if check_finite and tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                            raise UpdateRefused(f"tensor {name}: holds NaN or Inf (the worker's finite check is on)")
                        tensors[name] = lambda file=file, name=name: _read(file, name)
            except UpdateRefused:
                raise
            except Exception as exc:  # a truncated or foreign file: say which
                raise UpdateRefused(f"weights {file}: not a readable safetensors file ({type(exc).__name__}: {exc})") from None
            (folder / f"update-{number:05d}.safetensors").symlink_to(file.resolve())
        if not tensors:
            raise UpdateRefused(f"weights {weights}: the files hold no tensors")
        if (problem := layer_problem(list(tensors), self.checkpoint)) is not None:
            raise UpdateRefused(problem)
        return tensors

    def _pulled(
        self, message: UpdateWeights, folder: Path, check_finite: bool, timeout_s: float, keys: KeyPair | None
    ) -> dict[str, Callable[[], torch.Tensor]]:
        """A published update pulled into one safetensors file in ``folder``, laid out from its manifest."""
        laid_out: dict[str, Callable[[], torch.Tensor]] = {}

        def into(specs: list[TensorSpec]) -> list[torch.Tensor]:
            if (problem := layer_problem([spec.name for spec in specs], self.checkpoint)) is not None:
                raise UpdateRefused(problem)
            views = _safetensors_file(folder / "update.safetensors", specs)
            for spec, view in zip(specs, views, strict=True):
                laid_out[spec.name] = lambda view=view, spec=spec: view.clone().view(DTYPES[spec.dtype]).view(spec.shape)
            return views

        try:
            pull_update(
                message.source or "", message.update, self.checkpoint, check_finite, timeout_s, pull_keys(message.source_key, keys), into=into
            )
        except UpdateBroken as exc:  # only the file was written: the engine is untouched
            raise UpdateRefused(str(exc).split("; ")[0]) from None
        return laid_out


def _read(file: Path, name: str) -> torch.Tensor:
    from safetensors import safe_open

    with safe_open(str(file), framework="pt") as handle:
        return handle.get_tensor(name)


def _safetensors_file(path: Path, specs: list[TensorSpec]) -> list[torch.Tensor]:
    """A safetensors file at ``path`` holding ``specs``, its data not yet written: each tensor's bytes as a flat uint8
    view of the file, mapped shared (what is written into a view is in the file)."""
    header: dict[str, Any] = {}
    offset = 0
    for spec in specs:
        dtype = DTYPES[spec.dtype]
        if dtype not in SAFETENSORS_DTYPES:
            raise UpdateRefused(f"tensor {spec.name}: dtype {spec.dtype} has no safetensors name; engine vllm cannot load it")
        nbytes = dtype.itemsize
        for size in spec.shape:
            nbytes *= size
        header[spec.name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(spec.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    start = 8 + len(text)
    with open(path, "wb") as handle:
        handle.write(struct.pack("<Q", len(text)) + text)
        handle.truncate(start + offset)
    flat = torch.from_file(str(path), shared=True, size=start + offset, dtype=torch.uint8)
    return [flat[start + entry["data_offsets"][0] : start + entry["data_offsets"][1]] for entry in header.values()]
