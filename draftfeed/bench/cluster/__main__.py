"""``python -m draftfeed.bench.cluster simulate FRONTEND BACKEND LOAD_JSON PART`` or ``... forward [HEARTBEAT_S]``."""

from __future__ import annotations

import json

from draftfeed.bench.cluster.forwarder import forward
from draftfeed.bench.cluster.load import Load
from draftfeed.bench.cluster.simulator import SimulatedCluster


def main() -> None:
    """``python -m draftfeed.bench.cluster simulate FRONTEND BACKEND LOAD_JSON PART``: start (and say so on a line),
    run once a line comes on stdin, leave, and print the report's JSON with its samples; ``python -m
    draftfeed.bench.cluster forward``: the policy-free forwarder."""
    import sys

    command, *args = sys.argv[1:]
    if command == "forward":
        forward(float(args[0]) if args else 1.0)
        return
    frontend, backend, load_json, part = args
    cluster = SimulatedCluster(frontend, backend, Load.model_validate_json(load_json), int(part))
    try:
        cluster.start()
        print(json.dumps({"started": True}), flush=True)
        cluster.keep_alive(until=sys.stdin)  # go: every process has started
        run = cluster.run()
        cluster.leave()
        print(json.dumps(run.report(samples=True)), flush=True)
    finally:
        cluster.close()


if __name__ == "__main__":
    main()
