"""``draftfeed target update``: a service's workers load new weights in place (docs/versions.md)."""

from __future__ import annotations

import argparse

from draftfeed.launch import flags
from draftfeed.launch.options import PeerKeyFiles
from draftfeed.target_updates import format_report, update_target


def run_target(args: argparse.Namespace) -> int:
    """Print how each worker went; exit 1 unless every worker told took the update."""
    keys = flags.from_args(PeerKeyFiles, args).peer_keys("rank", required=False)
    report = update_target(args.broker, args.service, args.weights, args.version, timeout_s=args.timeout, keys=keys, at_once=args.at_once)
    print(format_report(report))
    return 0 if report.workers and all(result.ok for result in report.workers) else 1
