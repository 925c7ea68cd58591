"""``draftfeed store info`` and ``draftfeed store verify``: what a store holds, and whether every shard in its
index reads back as written."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from safetensors import safe_open

from draftfeed.store.identity import StoreIdentity
from draftfeed.store.index import IndexFile, ShardRecord
from draftfeed.store.shards import SHARD_SUFFIX, UNFINISHED_SUFFIX, file_sha256, tensor_name
from draftfeed.store.store import MANIFEST_NAME, read_manifest, shard_problem


@dataclass
class Contents:
    records: list[ShardRecord]
    skipped_lines: list[str]  # index lines that are not records (cut short by a crash)
    unindexed: list[str] = field(default_factory=list)  # files under shards/ no index line names

    @property
    def batch_count(self) -> int:
        return len({batch.key for record in self.records for batch in record.batches})


def contents(path: Path) -> Contents:
    records, skipped = IndexFile(path).read_new()
    named = {record.shard for record in records}
    shards = path / "shards"
    files = sorted(p for p in shards.rglob("*") if p.is_file()) if shards.is_dir() else []
    return Contents(records, skipped, [str(p.relative_to(path)) for p in files if str(p.relative_to(path)) not in named])


def info_lines(path: Path) -> list[str]:
    identity = read_manifest(path)
    if identity is None:
        raise FileNotFoundError(f"there is no store at {path} (no {MANIFEST_NAME})")
    found = contents(path)
    seen: set[str] = set()  # entries: a batch at one target version
    keys: set[str] = set()
    versions: Counter[int | None] = Counter()
    tokens = nbytes = 0
    for record in found.records:
        for batch in record.batches:
            if batch.entry not in seen:
                seen.add(batch.entry)
                keys.add(batch.key)
                versions[batch.target_version] += 1
                tokens, nbytes = tokens + batch.tokens, nbytes + batch.nbytes
    target = ", ".join(f"{name}={value}" for name, value in identity.target.model_dump().items() if name != "task")
    per_token = f"{nbytes / tokens:,.0f} bytes per token" if tokens else "no tokens"
    on_disk = sum(record.size for record in found.records)
    return [
        f"store: {path}",
        f"task: {identity.task}",
        f"target: {target}",
        f"form: {_form(identity)}",
        f"vocab mapping: {identity.mapping_digest or 'identity (the whole target vocab)'}",
        f"batches: {len(keys)}",
        f"target versions: {_versions(versions)}",
        f"tokens: {tokens}",
        f"supervision: {nbytes:,} bytes, {per_token}; {on_disk:,} bytes on disk",
        f"shards: {len(found.records)} from {len({r.writer for r in found.records})} recording ranks",
    ]


def _versions(versions: Counter[int | None]) -> str:
    """'0 (12 batches), 1 (5 batches)'; a batch held at two versions counts at each."""
    if not versions:
        return "none recorded"
    return ", ".join(
        f"{'not said' if version is None else version} ({count} batch{'es' if count != 1 else ''})"
        for version, count in sorted(versions.items(), key=lambda item: -1 if item[0] is None else item[0])
    )


def _form(identity: StoreIdentity) -> str:
    """How the store's batches were sent, in words."""
    if identity.task == "dspark":
        return "hidden states (the one form of DSpark)"
    if identity.task == "dflash" and not getattr(identity.target, "capture_logits", False):
        return "layer hidden states, no logits (the one form of DFlash without capture_logits)"
    return ", ".join(identity.forms)


def verify(path: Path) -> tuple[list[str], list[str], int]:
    """(failures, notes, batches): failures are shards in the index that do not read back as written; notes are what
    a crash leaves and the store ignores (a cut index line, an unfinished or unindexed shard file); batches are the
    distinct batches the index names."""
    if read_manifest(path) is None:
        raise FileNotFoundError(f"there is no store at {path} (no {MANIFEST_NAME})")
    found = contents(path)
    failures = [problem for record in found.records if (problem := _shard_failure(path, record))]
    notes = list(found.skipped_lines)
    for name in found.unindexed:
        why = "an unfinished shard (its writer was killed)" if name.endswith(UNFINISHED_SUFFIX) else "a shard no index line names"
        if name.endswith(SHARD_SUFFIX) or name.endswith(UNFINISHED_SUFFIX):
            notes.append(f"{name}: {why}; not part of the store, safe to delete")
    return failures, notes, found.batch_count


def _shard_failure(store: Path, record: ShardRecord) -> str | None:
    problem = shard_problem(store, record)
    if problem:
        return problem
    shard = store / record.shard
    if file_sha256(shard) != record.sha256:
        return f"{record.shard}: its sha256 is not the one in the index (the file changed after it was written)"
    try:
        with safe_open(str(shard), framework="pt", device="cpu") as handle:
            names = set(handle.keys())
            for batch in record.batches:
                for name, spec in batch.fields.items():
                    stored = tensor_name(batch.entry, name)
                    if stored not in names:
                        return f"{record.shard}: batch {batch.key} has no {name}"
                    got = handle.get_slice(stored)
                    if got.get_dtype().lower() != _safetensors_dtype(spec.dtype) or list(got.get_shape()) != spec.shape:
                        return f"{record.shard}: {name} of batch {batch.key} is {got.get_dtype()} {got.get_shape()}, the index says {spec.dtype} {spec.shape}"
    except Exception as exc:  # safetensors' own errors for a file it cannot parse
        return f"{record.shard}: cannot be read as safetensors ({exc})"
    return None


_DTYPES = {
    "float32": "f32",
    "float16": "f16",
    "bfloat16": "bf16",
    "float64": "f64",
    "int64": "i64",
    "int32": "i32",
    "int16": "i16",
    "int8": "i8",
    "uint8": "u8",
    "bool": "bool",
}


def _safetensors_dtype(torch_name: str) -> str:
    return _DTYPES.get(torch_name, torch_name)
