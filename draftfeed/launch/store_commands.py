"""``draftfeed store info PATH``, ``draftfeed store verify PATH`` and ``draftfeed store export PATH`` (docs/store.md)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from draftfeed.schemas.errors import UsageError


def run_store(args: argparse.Namespace) -> int:
    from draftfeed.store.inspect import info_lines, verify

    path = Path(args.path)
    if args.store_command == "export":
        return _export(path, args)
    try:
        if args.store_command == "info":
            print("\n".join(info_lines(path)))
            return 0
        failures, notes, batches = verify(path)
    except FileNotFoundError as exc:
        raise UsageError(f"{exc}: give the folder a rank recorded into (store=PATH)") from None
    for line in failures:
        print(f"FAILED {line}")
    for line in notes:
        print(f"note: {line}")
    if failures:
        print(f"{path}: {len(failures)} shards in the index do not read back as written (of {batches} batches)", file=sys.stderr)
        return 1
    print(f"{path}: {batches} batches checked, every shard reads back as written")
    return 0


def _export(path: Path, args: argparse.Namespace) -> int:
    from draftfeed.store.export_speculators import export_speculators, named

    data = Path(args.data_path)
    report = export_speculators(path, data, Path(args.out) if args.out else data / "hidden_states", args.skip_missing)
    print(f"{report.out}: {report.written} of {report.rows} rows written as hs_{{i}}.safetensors ({report.dtype or 'no'} hidden states)")
    if report.missing:
        print(f"no file for {named(report.missing)}: the store lacks them (--skip-missing)")
    print(f"each sample's layers, as speculators counts them: {report.layers}, {report.hidden_size} wide")
    return 0
