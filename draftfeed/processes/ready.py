"""The ready line: how a draftfeed process tells whoever started it that it is serving, and where.

A process prints ``READY_PREFIX`` then one JSON object (its role and endpoints) once it is ready;
processes/commands.py waits for that line.
"""

from __future__ import annotations

import json

READY_PREFIX = "DRAFTFEED-READY "


def announce_ready(**fields: str) -> None:
    """Print the ready line: the prefix, then ``fields`` as JSON."""
    print(READY_PREFIX + json.dumps(fields), flush=True)
