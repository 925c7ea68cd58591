"""The rows of a speculators dataset (its ``--data-path``): an HF ``datasets`` dataset saved with ``save_to_disk``,
read without ``datasets``, row by row, for ``draftfeed store export --format speculators``.

``save_to_disk`` writes ``state.json`` (its ``_data_files`` lists the data files in row order), ``dataset_info.json``
and the data files, each an Arrow IPC stream (``data-00000-of-00001.arrow``). Only the ``input_ids`` column is
read, with pyarrow (which ``datasets`` needs, so speculators' environment has it), imported when first used.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from draftfeed.schemas.errors import UsageError

STATE_NAME = "state.json"
COLUMN = "input_ids"


class DataFile(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    filename: str = Field(min_length=1)


class DatasetState(BaseModel):
    """The part of ``save_to_disk``'s state.json that says where the rows are."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    data_files: list[DataFile] = Field(alias="_data_files")


def data_files(data: Path) -> list[Path]:
    """The dataset's data files in row order; a UsageError naming what is wrong with the folder."""
    state = data / STATE_NAME
    if not state.is_file():
        if (data / "dataset_dict.json").is_file():
            raise UsageError(f"{data} holds a DatasetDict: give the folder of one split (speculators' --data-path), e.g. {data}/train")
        raise UsageError(f"{data} is not a dataset saved with save_to_disk (no {STATE_NAME}): give speculators' --data-path")
    try:
        files = DatasetState.model_validate_json(state.read_bytes()).data_files
    except (OSError, ValidationError) as exc:
        why = exc.errors()[0]["msg"] if isinstance(exc, ValidationError) else exc.strerror or exc
        raise UsageError(f"cannot read {state}: {why}") from None
    paths = [data / file.filename for file in files]
    absent = [str(path) for path in paths if not path.is_file()]
    if absent:
        raise UsageError(f"{state} names {absent[0]}, which is not there ({len(absent)} of {len(paths)} data files missing)")
    return paths


def row_input_ids(data: Path) -> Iterator[torch.Tensor]:
    """Each row's ``input_ids`` (1-D, the column's integer dtype), in row order (row i of speculators is the i-th)."""
    files = data_files(data)
    pa = _pyarrow()
    for path in files:
        try:
            with pa.memory_map(str(path)) as source:
                reader = pa.ipc.open_stream(source)
                _check_column(reader.schema, path, pa)
                for batch in reader:
                    yield from _rows(batch.column(COLUMN), path)
        except pa.ArrowException as exc:
            raise UsageError(f"{path} cannot be read as an Arrow stream ({str(exc).splitlines()[0]}): is {data} a save_to_disk folder?") from None


def _check_column(schema: Any, path: Path, pa: Any) -> None:
    if COLUMN not in schema.names:
        raise UsageError(f"{path} has no {COLUMN} column (its columns: {', '.join(schema.names)}): give speculators' --data-path")
    kind = schema.field(COLUMN).type
    if not (pa.types.is_list(kind) or pa.types.is_large_list(kind)) or not pa.types.is_integer(kind.value_type):
        raise UsageError(f"{path}: its {COLUMN} column is {kind}, not a list of integers")


def _rows(column: Any, path: Path) -> Iterator[torch.Tensor]:
    if column.null_count:
        raise UsageError(f"{path}: {column.null_count} rows have no {COLUMN}")
    offsets = column.offsets.to_numpy()
    values = column.flatten().to_numpy(zero_copy_only=False)
    base = offsets[0]
    for start, end in zip(offsets[:-1], offsets[1:]):
        yield torch.from_numpy(values[start - base : end - base].copy())


def _pyarrow() -> Any:
    try:
        import pyarrow.ipc  # binds pyarrow, with its ipc submodule
    except ImportError:
        raise UsageError(
            "reading a speculators dataset needs pyarrow, which is not installed here: `pip install pyarrow`, or run this "
            "command where speculators (and so datasets) is installed"
        ) from None
    return pyarrow
