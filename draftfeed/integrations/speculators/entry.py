"""Running speculators' ``train`` with the draftfeed backend registered: its config resolved from the same flags it
takes on its own command line, and its ``main`` called in this process."""

from __future__ import annotations

import sys
from collections.abc import Sequence

USAGE = "usage: python -m draftfeed.integrations.speculators train <speculators' train flags> --hidden-states-backend draftfeed --draftfeed-url draftfeed://BROKER:PORT/SERVICE"


def main(argv: Sequence[str]) -> int:
    argv = list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    if argv[0] != "train":
        print(f"draftfeed.integrations.speculators: {argv[0]!r} is not a command; {USAGE}", file=sys.stderr)
        return 2
    try:
        from speculators.train.cli import main as train
    except ImportError as error:
        print(f"draftfeed.integrations.speculators: speculators is not installed here ({error}); pip install speculators", file=sys.stderr)
        return 1
    from draftfeed.integrations.speculators.backend import Refused, register

    register()  # before the config is resolved: speculators reads the backends' flags then
    from speculators.train.config import TrainConfig

    try:
        train(TrainConfig.resolve(argv[1:]))
    except Refused as refusal:
        print(f"draftfeed.integrations.speculators: {refusal}", file=sys.stderr)
        return 1
    return 0
