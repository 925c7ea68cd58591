"""A store folder as one rank uses it: its identity, the batches in it, the recorder that adds to it.

Layout (docs/store.md): ``store.json`` (the StoreIdentity, written once by the first rank), ``index.jsonl``
(index.py), ``shards/WRITER/NNNNNN.safetensors`` (one shard set per recording rank) and ``weights/NAME.safetensors``
(the target weights a rank fetched while recording, so that a replaying rank needs no worker for them).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import uuid
from pathlib import Path
from typing import Literal

import torch
from pydantic import ValidationError
from safetensors.torch import load_file

from draftfeed.dataplane.frames.codec import dtype_name
from draftfeed.schemas.messages import VersionWanted
from draftfeed.store.errors import BatchNotInStore, StoreError, StoreWriteError
from draftfeed.store.identity import STORE_FORMAT, StoreIdentity, batch_key
from draftfeed.store.index import BatchRecord, IndexFile, ShardRecord
from draftfeed.store.shards import ShardReader, write_shard
from draftfeed.store.versions import Recorded, describe_recorded, pick_version
from draftfeed.store.writer import Recorder

log = logging.getLogger("draftfeed.store")
StoreMode = Literal["record", "replay", "cache"]
MANIFEST_NAME = "store.json"
WEIGHTS_FOLDER = "weights"


class SupervisionStore:
    """One store folder opened in one mode. ``bind`` must come before the first batch: it checks (or, for a new
    store, writes) what the batches are computed with."""

    def __init__(self, path: str | Path, mode: StoreMode, writer: str, shard_bytes: int, queue_batches: int) -> None:
        self.path = Path(path)
        self.mode = mode
        if mode == "replay" and not (self.path / MANIFEST_NAME).is_file():
            raise StoreError(f"there is no store at {self.path} (no {MANIFEST_NAME}): record one first, with store_mode='record' or 'cache'")
        if mode != "replay":
            try:
                self.path.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise StoreWriteError(f"cannot create the store folder {self.path}: {exc.strerror or exc}") from None
        self.identity = read_manifest(self.path)
        self.problems: list[str] = []  # shards and index lines skipped at open, each with why
        self._index = IndexFile(self.path)
        self._batches: dict[str, dict[Recorded, tuple[Path, BatchRecord]]] = {}  # by key, then by target version
        self._lock = threading.Lock()
        self._reader = ShardReader()
        self._digest: str | None = None
        self._writer = writer
        self._shard_bytes = shard_bytes
        self._queue_batches = queue_batches
        self._recorder: Recorder | None = None
        self.refresh()
        for problem in self.problems:
            log.warning("draftfeed: store %s: %s", self.path, problem)

    # ------------------------------------------------------------ identity
    def bind(self, identity: StoreIdentity) -> None:
        """Use the store for batches computed with ``identity``; a StoreError naming each field that differs if
        the store holds another's."""
        if self.identity is None:
            self.identity = write_manifest(self.path, identity)
        mismatch = identity.describe_mismatch(self.identity, "this rank", "the store")
        if mismatch:
            raise StoreError(f"the store at {self.path} holds supervision computed otherwise: {mismatch}; give this run another store path")
        self._digest = self.identity.digest()
        if self.mode != "replay" and self._recorder is None:
            self._recorder = Recorder(self.path, self._writer, self._index, self._add_shard, self._shard_bytes, self._queue_batches)

    @property
    def bound(self) -> bool:
        return self._digest is not None

    def key(self, tensors: dict[str, torch.Tensor]) -> str:
        if self._digest is None:
            raise StoreError(f"the store at {self.path} is used before it was bound to a target")
        return batch_key(self._digest, tensors)

    # ------------------------------------------------------------ batches
    def refresh(self) -> None:
        """Take in the shards other ranks finished since the last look."""
        records, problems = self._index.read_new()
        self.problems.extend(problems)
        for record in records:
            self._add_shard(record)

    def _add_shard(self, record: ShardRecord) -> None:
        problem = shard_problem(self.path, record)
        if problem:
            self.problems.append(problem)
            return
        shard = self.path / record.shard
        with self._lock:
            for batch in record.batches:
                self._batches.setdefault(batch.key, {}).setdefault(batch.target_version, (shard, batch))

    def recorded(self, key: str) -> set[Recorded]:
        """The target versions the store holds the batch ``key`` at (None: recorded without one); empty: not held."""
        pending = set(self._recorder.pending(key)) if self._recorder is not None else set()
        with self._lock:
            return pending | set(self._batches.get(key, {}))

    def find(self, key: str, wanted: VersionWanted | None) -> tuple[bool, Recorded]:
        """(found, version): the recorded version of the batch ``key`` that answers ``wanted`` (versions.py); a
        cache looks again at what other ranks recorded before it says no."""
        found = pick_version(self.recorded(key), wanted)
        if not found[0] and self.mode == "cache":
            self.refresh()
            found = pick_version(self.recorded(key), wanted)
        return found

    def __contains__(self, key: str) -> bool:
        """Whether the store holds the batch ``key`` at any version."""
        return self.find(key, None)[0]

    def read(self, key: str, version: Recorded) -> dict[str, torch.Tensor]:
        """The stored tensors of the batch ``key`` computed at target ``version``, as a worker sent them."""
        if self._recorder is not None and (pending := self._recorder.pending(key).get(version)) is not None:
            return dict(pending)
        with self._lock:
            found = self._batches.get(key, {}).get(version)
        if found is None:
            raise BatchNotInStore(f"batch {key} is not in the store at {self.path} {describe_recorded([version])}")
        shard, batch = found
        with self._lock:  # the reader's open files are shared
            try:
                tensors = self._reader.read(shard, batch.entry, list(batch.fields))
            except Exception as exc:  # safetensors raises its own errors for a damaged file
                raise StoreError(f"the store's shard {shard} cannot be read ({exc}); run `draftfeed store verify {self.path}`") from None
        for name, spec in batch.fields.items():
            got = tensors[name]
            if dtype_name(got.dtype) != spec.dtype or list(got.shape) != spec.shape:
                raise StoreError(
                    f"the store's shard {shard} holds {name} of batch {key} as {got.dtype} {list(got.shape)}, its index says "
                    f"{spec.dtype} {spec.shape}; run `draftfeed store verify {self.path}`"
                )
        return tensors

    @property
    def batches(self) -> int:
        with self._lock:
            return len(self._batches)

    # ------------------------------------------------------------ recording
    def admit(self, timeout_s: float) -> None:
        """Wait until the recorder can take one more batch (raises its error, if writing failed)."""
        self._recording().admit(timeout_s)

    def record(self, key: str, version: Recorded, tensors: dict[str, torch.Tensor], tokens: int) -> None:
        """Write one batch computed at target ``version`` (in the background), unless the store holds it at that
        version already (a second epoch in record mode)."""
        with self._lock:
            if version in self._batches.get(key, {}):
                return
        self._recording().put(key, version, tensors, tokens)

    def _recording(self) -> Recorder:
        if self._recorder is None:
            raise StoreError(f"the store at {self.path} is open in {self.mode} mode (or not bound yet): it records nothing")
        return self._recorder

    # ------------------------------------------------------------ weights
    def weight(self, name: str) -> torch.Tensor | None:
        """A target weight stored by a recording rank, or None."""
        path = self.path / WEIGHTS_FOLDER / f"{name}.safetensors"
        if not path.is_file():
            return None
        return load_file(str(path))["weight"]

    def put_weight(self, name: str, weight: torch.Tensor) -> None:
        """Keep a target weight beside the batches (the first rank's copy stays)."""
        folder = self.path / WEIGHTS_FOLDER
        path = folder / f"{name}.safetensors"
        if self.mode == "replay" or path.exists():
            return
        try:
            folder.mkdir(exist_ok=True)
            staged = folder / f".{name}.{uuid.uuid4().hex}"
            write_shard(staged, {"weight": weight.detach().to("cpu").contiguous()})
            try:
                os.link(staged, path)  # exactly one rank's copy lands
            except FileExistsError:
                pass
            finally:
                staged.unlink(missing_ok=True)
        except OSError as exc:
            raise StoreWriteError(f"cannot write the weight {path}: {exc.strerror or exc}") from None

    def flush(self, timeout_s: float) -> None:
        """Write what was recorded so far into the store for good (a shard and its index line), if anything was."""
        if self._recorder is not None:
            self._recorder.flush(timeout_s)

    def close(self, timeout_s: float) -> None:
        """Finish recording (the last shard is written) and release the files; the recorder's error, if any."""
        recorder, self._recorder = self._recorder, None
        try:
            if recorder is not None:
                recorder.close(timeout_s)
        finally:
            with self._lock:
                self._reader.close()


def read_manifest(path: Path) -> StoreIdentity | None:
    """The identity in ``path``'s store.json, None if there is none; a StoreError for one that cannot be read."""
    manifest = path / MANIFEST_NAME
    try:
        text = manifest.read_text()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise StoreError(f"cannot read {manifest}: {exc.strerror or exc}") from None
    try:
        found = json.loads(text).get("format")
    except (ValueError, AttributeError):
        found = None
    if found != STORE_FORMAT:
        raise StoreError(f"{manifest} is not a draftfeed store of format {STORE_FORMAT} (it says format {found!r})")
    try:
        return StoreIdentity.model_validate_json(text)
    except ValidationError as exc:
        raise StoreError(f"{manifest} cannot be read: {exc.errors()[0]['loc']}: {exc.errors()[0]['msg']}") from None


def write_manifest(path: Path, identity: StoreIdentity) -> StoreIdentity:
    """Write store.json unless another rank was first; the identity in force either way."""
    manifest = path / MANIFEST_NAME
    staged = path / f".{MANIFEST_NAME}.{uuid.uuid4().hex}"
    try:
        staged.write_text(identity.model_dump_json(indent=1) + "\n")
        os.link(staged, manifest)
    except FileExistsError:
        pass
    except OSError as exc:
        raise StoreWriteError(f"cannot write {manifest}: {exc.strerror or exc}") from None
    finally:
        staged.unlink(missing_ok=True)
    found = read_manifest(path)
    assert found is not None
    return found


def shard_problem(store: Path, record: ShardRecord) -> str | None:
    """Why a shard in the index cannot be read back as written (None when its file is there at its size)."""
    shard = (store / record.shard).resolve()
    if not shard.is_relative_to(store.resolve()):
        return f"the index names {record.shard}, outside the store: skipped"
    try:
        size = shard.stat().st_size
    except FileNotFoundError:
        return f"{record.shard} is in the index but not on disk: its {len(record.batches)} batches are skipped"
    if size != record.size:
        return f"{record.shard} is {size} bytes, the index says {record.size}: its {len(record.batches)} batches are skipped"
    return None
