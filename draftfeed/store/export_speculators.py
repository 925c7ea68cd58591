"""``draftfeed store export --format speculators``: a DFlash store as the hidden-state files of speculators' offline
training, one ``hs_{i}.safetensors`` per row i of its dataset (docs/store.md, "Exporting for speculators").

Row i's file is the sample of the batch the speculators backend sends for that row (``samples.row_batch``): its key
is found from the row's ``input_ids``, its stored ``hidden_states`` become the sample with ``samples.to_sample``
(the dtype as stored). Every row's key is looked up before anything is written; each file is written under a
temporary name, flushed and renamed into place, so a file under its name is always whole.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict
from safetensors.torch import save

from draftfeed.integrations.speculators.samples import row_batch, to_sample
from draftfeed.schemas.errors import UsageError
from draftfeed.store.errors import StoreError, StoreWriteError
from draftfeed.store.identity import StoreIdentity
from draftfeed.store.shards import write_whole
from draftfeed.store.speculators_dataset import row_input_ids
from draftfeed.store.store import MANIFEST_NAME, SupervisionStore, read_manifest

SHOWN_MISSING = 5  # rows named in a message about rows the store lacks


class Missing(BaseModel):
    model_config = ConfigDict(frozen=True)

    row: int
    key: str


class ExportReport(BaseModel):
    """What an export wrote."""

    model_config = ConfigDict(frozen=True)

    rows: int
    written: int
    missing: list[Missing]
    out: Path
    dtype: str
    layers: list[int]  # speculators' layer ids of a sample's hidden_states, in order (the last one is L)
    hidden_size: int


def sample_file(out: Path, row: int) -> Path:
    return out / f"hs_{row}.safetensors"


def export_speculators(store_path: Path, data: Path, out: Path, skip_missing: bool = False) -> ExportReport:
    """Write ``out/hs_{i}.safetensors`` for every row i of the dataset at ``data``. A row the store lacks is a
    UsageError naming it and its key (nothing written), or with ``skip_missing`` gets no file."""
    identity = _dflash_identity(store_path)
    layers = _speculators_layers(store_path, identity)
    hidden_size = identity.target.hidden_size
    store = SupervisionStore(store_path, "replay", "export", shard_bytes=1, queue_batches=1)
    try:
        store.bind(identity)
        rows, missing = 0, []
        for row, ids in enumerate(row_input_ids(data)):
            rows += 1
            key = store.key(row_batch(ids))
            if key not in store:
                missing.append(Missing(row=row, key=key))
        if missing and not skip_missing:
            raise UsageError(
                f"the store at {store_path} lacks {named(missing)} of {data}: nothing written; record them (store_mode='record' "
                "or 'cache'), or pass --skip-missing"
            )
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreWriteError(f"cannot create {out}: {exc.strerror or exc}; give another --out") from None
        dtype, written = "", 0
        for row, ids in enumerate(row_input_ids(data)):
            key = store.key(row_batch(ids))
            found, version = store.find(key, None)  # the newest version recorded
            if not found:
                continue
            hidden = store.read(key, version)["hidden_states"]
            if hidden.shape[:2] != (1, ids.numel()):
                raise StoreError(f"batch {key} (row {row}) holds hidden_states of shape {list(hidden.shape)} for {ids.numel()} tokens")
            _write_atomic(sample_file(out, row), to_sample(hidden, ids, hidden_size))
            dtype, written = str(hidden.dtype).removeprefix("torch."), written + 1
    finally:
        store.close(timeout_s=60.0)
    return ExportReport(rows=rows, written=written, missing=missing, out=out, dtype=dtype, layers=layers, hidden_size=hidden_size)


def _dflash_identity(store_path: Path) -> StoreIdentity:
    identity = read_manifest(store_path)
    if identity is None:
        raise UsageError(f"there is no store at {store_path} (no {MANIFEST_NAME}): give the folder a rank recorded into (store=PATH)")
    if identity.task != "dflash":
        raise UsageError(
            f"the store at {store_path} holds {identity.task} supervision: speculators' files are made from a DFlash store "
            "(a RemoteDFlashTarget's, as the speculators backend records)"
        )
    return identity


def _speculators_layers(store_path: Path, identity: StoreIdentity) -> list[int]:
    """speculators' ids of the store's DFlash layers (k + 1; the last layer L - 1 is speculators' L), which must end
    with the last layer: a speculators sample ends with it (samples.py)."""
    ids = list(identity.target.target_layer_ids)  # type: ignore[union-attr]
    last = identity.target.num_hidden_layers
    if ids[-1] != last - 1:
        raise UsageError(
            f"the store at {store_path} holds DFlash layers {ids}, which do not end with the last layer ({last - 1}): a "
            f"speculators sample ends with it; record with workers serving --target-layer-ids ending in {last - 1}"
        )
    return [k + 1 for k in ids]


def named(missing: list[Missing]) -> str:
    """'row 3 (key K)', or 'rows 3 (key K), 5 (key L) and 2 more'."""
    shown = ", ".join(f"{m.row} (key {m.key})" for m in missing[:SHOWN_MISSING])
    more = f" and {len(missing) - SHOWN_MISSING} more" if len(missing) > SHOWN_MISSING else ""
    return f"{'row' if len(missing) == 1 else 'rows'} {shown}{more}"


def _write_atomic(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    data = save({name: tensor.contiguous() for name, tensor in tensors.items()})
    try:
        write_whole(path, data, path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp"))
    except OSError as exc:
        raise StoreWriteError(f"writing {path} failed: {exc.strerror or exc}; free space there, or give another --out") from None
