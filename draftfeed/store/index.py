"""The store's index: one append-only file that every recording rank shares, a line per finished shard.

A line is ``CRC32 JSON\\n``: the CRC32 (8 hex digits) of the JSON that follows, which is a ``ShardRecord``. A rank
appends a shard's line only after the shard file is written, flushed to disk and renamed into place, so a batch
is in the store exactly when its shard's line is: a rank killed while writing leaves no line, and its unfinished
shard file is never read. Appends hold an exclusive ``flock`` and are one ``write`` each, so lines of several
ranks never interleave; a line cut short by a crash fails its CRC and is skipped (and reported by ``verify``),
and the next append starts on a fresh line.
"""

from __future__ import annotations

import fcntl
import os
import zlib
from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from draftfeed.store.shards import entry_name

INDEX_NAME = "index.jsonl"


class FieldSpec(BaseModel):
    """dtype and shape of one stored tensor."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    dtype: str
    shape: list[Annotated[int, Field(ge=0)]]


class BatchRecord(BaseModel):
    """One batch in a shard: its key, the target version that computed it, its tensors (named ``ENTRY/FIELD`` in
    the shard: shards.entry_name), its size."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    key: str
    fields: dict[str, FieldSpec]
    tokens: Annotated[int, Field(ge=0)]  # real (attended) positions of the batch
    nbytes: Annotated[int, Field(ge=0)]  # bytes of its tensors
    target_version: Annotated[int, Field(ge=0)] | None = None  # None: recorded before workers said their version

    @property
    def entry(self) -> str:
        return entry_name(self.key, self.target_version)


class ShardRecord(BaseModel):
    """A finished shard: its path under the store, its size and sha256, who wrote it, the batches in it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    shard: str
    size: Annotated[int, Field(ge=0)]
    sha256: str
    writer: str
    batches: list[BatchRecord]


def encode_line(record: ShardRecord) -> bytes:
    payload = record.model_dump_json().encode()
    return b"%08x %s\n" % (zlib.crc32(payload), payload)


def decode_line(line: bytes) -> ShardRecord | str:
    """The record of one complete line (without its newline), or why it is not one."""
    crc, _, payload = line.partition(b" ")
    try:
        if int(crc, 16) != zlib.crc32(payload):
            return "its checksum does not match (a line cut short by a crash?)"
        return ShardRecord.model_validate_json(payload)
    except ValueError as exc:  # a CRC that is not hex; JSON that is not a ShardRecord (ValidationError is one)
        return f"it is not a shard record ({exc if not isinstance(exc, ValidationError) else exc.errors()[0]['msg']})"


class IndexFile:
    """Appends this rank's lines; reads every rank's lines, each once, as they appear."""

    def __init__(self, store: Path) -> None:
        self.path = store / INDEX_NAME
        self._offset = 0  # how far this reader has read: always at the start of a line

    def append(self, record: ShardRecord) -> None:
        line = encode_line(record)
        fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            size = os.fstat(fd).st_size
            if size and os.pread(fd, 1, size - 1) != b"\n":
                line = b"\n" + line  # the last writer died mid-line: start a fresh one
            os.write(fd, line)
            os.fsync(fd)
        finally:
            os.close(fd)  # releases the lock

    def read_new(self) -> tuple[list[ShardRecord], list[str]]:
        """The lines appended since the last call (complete ones only), and a problem per bad line."""
        try:
            with open(self.path, "rb") as file:
                file.seek(self._offset)
                data = file.read()
        except FileNotFoundError:
            return [], []
        end = data.rfind(b"\n") + 1  # a line still being written is read next time
        records, problems = [], []
        for line in data[:end].split(b"\n")[:-1]:
            decoded = decode_line(line)
            if isinstance(decoded, str):
                problems.append(f"{self.path}: a line at byte {self._offset} is skipped: {decoded}")
            else:
                records.append(decoded)
            self._offset += len(line) + 1
        return records, problems
