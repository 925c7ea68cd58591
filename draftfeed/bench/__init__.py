"""``draftfeed bench``: every scenario with real processes on loopback, each against a baseline measured
in the same run, reported as ratios (docs/performance.md explains each one).

``harness`` holds what the scenarios share and runs them; ``scenarios/`` holds one module per scenario.
"""

from draftfeed.bench.scenarios import SCENARIO_NAMES

__all__ = ["SCENARIO_NAMES"]
