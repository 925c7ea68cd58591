"""Weight updates in place on the vllm engine (docs/versions.md).

vLLM loads an update itself, through its own in-place reload (``reload_weights`` on every rank, from a folder of
safetensors files): each rank reads and shards the tensors, and vLLM runs its processing after loading again (on CPU
the GEMM weights it repacks). The engine's own ends of the target (TargetHead: embeddings, final norm, lm_head) take
theirs here. So an update reaches vLLM as a folder: a file update's files, linked once checked; a published update
pulled straight into one safetensors file in memory (/dev/shm), laid out from its manifest before the first piece
comes. The checks, and the rule of whole decoder layers, are whole_layer_updates.py's.
"""

from __future__ import annotations

import json
import shutil
import struct
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from draftfeed.consumers.engines.whole_layer_updates import SAFETENSORS_DTYPES, checked_files, checkpoint_tensors, pulled
from draftfeed.dataplane.frames.codec import DTYPES
from draftfeed.dataplane.weights.worker import UpdateBroken, UpdateRefused
from draftfeed.schemas.messages import TensorSpec, UpdateWeights
from draftfeed.security.keys import KeyPair


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
                files, tensors = checked_files("vllm", message.weights or "", self.checkpoint, check_finite)
                for number, file in enumerate(files):
                    (folder / f"update-{number:05d}.safetensors").symlink_to(file.resolve())
            else:
                lay_out = lambda specs: _safetensors_file(folder / "update.safetensors", specs)  # noqa: E731
                tensors = pulled("vllm", message, self.checkpoint, lay_out, check_finite, timeout_s, keys)
            try:
                self.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(folder), "is_checkpoint_format": True})
            except Exception as exc:  # vLLM's ranks may hold part of it
                raise UpdateBroken(f"vLLM's reload failed: {type(exc).__name__}: {exc}") from None
            head = self.head_weights()
            for name in tensors.keys() & head.keys():
                head[name].copy_(tensors[name]())
        finally:
            shutil.rmtree(folder, ignore_errors=True)


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
