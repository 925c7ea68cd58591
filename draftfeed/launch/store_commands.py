"""``draftfeed store info PATH`` and ``draftfeed store verify PATH`` (docs/store.md)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from draftfeed.schemas.errors import UsageError


def run_store(args: argparse.Namespace) -> int:
    from draftfeed.store.inspect import info_lines, verify

    path = Path(args.path)
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
