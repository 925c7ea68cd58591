"""Shard files: a safetensors file of many batches, each tensor named ``ENTRY/FIELD`` (``entry_name``).

A shard is written whole, under a temporary name in its folder, flushed to disk, then renamed into place and
its folder flushed: a file under a shard's final name is always complete. Its size and sha256 go into the
index (index.py), which ``verify`` checks the file against.
"""

from __future__ import annotations

import hashlib
import os
from collections import OrderedDict
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save

from draftfeed.store.errors import StoreWriteError

SHARD_SUFFIX = ".safetensors"
UNFINISHED_SUFFIX = ".unfinished"  # a shard being written (or left by a writer that was killed)


def entry_name(key: str, target_version: int | None) -> str:
    """A recorded batch's name in its shard: its key, and ``@N`` when it was computed at target version N (a store
    may hold one batch at several versions; docs/store.md, "Target versions")."""
    return key if target_version is None else f"{key}@{target_version}"


def tensor_name(entry: str, field: str) -> str:
    return f"{entry}/{field}"


def write_shard(path: Path, tensors: dict[str, torch.Tensor]) -> tuple[int, str]:
    """Write ``tensors`` (CPU, contiguous) as the shard at ``path``; its size and sha256. Nothing is left under
    ``path`` unless all of it was written."""
    data = save(tensors)
    try:
        write_whole(path, data, path.with_name(path.name + UNFINISHED_SUFFIX))
    except OSError as exc:
        raise StoreWriteError(f"writing the shard {path} failed: {exc.strerror or exc}; free space there, or record elsewhere") from None
    return len(data), hashlib.sha256(data).hexdigest()


def write_whole(path: Path, data: bytes, staged: Path) -> None:
    """Write ``data`` at ``staged``, flush it to the disk, rename it to ``path`` and flush the folder: nothing is left
    under ``path`` unless all of it was written, and nothing at ``staged`` if writing failed (the OSError is raised)."""
    try:
        fd = os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(staged, path)
        fsync_folder(path.parent)
    except OSError:
        staged.unlink(missing_ok=True)
        raise


def fsync_folder(folder: Path) -> None:
    """Flush a folder's entries (a rename in it) to the disk."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(16 << 20):
            digest.update(chunk)
    return digest.hexdigest()


class ShardReader:
    """Reads batches from shards, keeping the last few shard files open (safetensors maps them)."""

    def __init__(self, open_files: int = 8) -> None:
        self._open: OrderedDict[Path, object] = OrderedDict()
        self._limit = open_files

    def read(self, path: Path, entry: str, fields: list[str]) -> dict[str, torch.Tensor]:
        handle = self._handle(path)
        return {field: handle.get_tensor(tensor_name(entry, field)) for field in fields}  # type: ignore[attr-defined]

    def _handle(self, path: Path) -> object:
        handle = self._open.pop(path, None)
        if handle is None:
            handle = safe_open(str(path), framework="pt", device="cpu")
            while len(self._open) >= self._limit:
                self._open.popitem(last=False)
        self._open[path] = handle
        return handle

    def close(self) -> None:
        self._open.clear()
