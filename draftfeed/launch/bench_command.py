"""``draftfeed bench``: every scenario (or those named), its table, its JSON and docs/performance.md."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from draftfeed.bench import SCENARIO_NAMES
from draftfeed.bench.cluster import Load as ClusterLoad
from draftfeed.launch import flags
from draftfeed.launch.signals import stopping_children


def run_bench(args: argparse.Namespace) -> int:
    return stopping_children("bench", lambda: _bench(args))


def _bench(args: argparse.Namespace) -> int:
    import tempfile

    from draftfeed.bench.harness import Row, format_table, run, to_json
    from draftfeed.processes import children

    if args.from_json:
        data = json.loads(Path(args.from_json).read_text())
        rows = [Row(**{k: v for k, v in row.items() if k != "ratio"}) for row in data["rows"]]
        args.quick, machine = data["quick"], data.get("machine")
    else:
        machine = None
        with tempfile.TemporaryDirectory(prefix="draftfeed-bench-") as workdir:
            try:
                rows = run(args.scenario or SCENARIO_NAMES, args.quick, Path(workdir), settings=[flags.from_args(ClusterLoad, args)])
            finally:
                children.stop_all()  # before its folder goes
    command = "draftfeed bench" + (" --quick" if args.quick else "")
    print(format_table(rows))
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(to_json(rows, args.quick), indent=2))
    if args.report:
        from draftfeed.bench.report import render

        print(f"wrote {render(rows, args.quick, command, Path(args.docs), machine)}")
    return 0
