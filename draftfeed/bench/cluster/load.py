"""What the cluster scenario simulates (``Load``, whose fields are ``draftfeed bench``'s cluster flags) and what a
run measured (``ClusterRun``), merged over the simulator processes (``merge``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

from draftfeed.schemas.settings import Settings, setting

PEERS_PER_PROCESS = 4000  # a process's file descriptors (two a socket) bound its peers


class Load(Settings):
    """The simulated cluster: how many peers, how fast its workers, how long the run. ``draftfeed bench --scenario
    cluster`` makes a flag of each field (launch/flags.py)."""

    GROUP: ClassVar[str] = "the cluster scenario"

    ranks: int = setting(1000, "cluster scenario: simulated training ranks")
    workers: int = setting(256, "cluster scenario: simulated workers")
    compute_ms: float = setting(60.0, "cluster scenario: milliseconds a simulated worker computes a request")
    prefetch: int = setting(2, "cluster scenario: requests each rank keeps in flight (its prefetch_depth)")
    capacity: int = setting(2, "cluster scenario: requests each worker holds (its --capacity)")
    warmup_s: float = setting(5.0, "cluster scenario: seconds served before measuring")
    measure_s: float = setting(20.0, "cluster scenario: seconds measured")
    processes: int = setting(
        0, "cluster scenario: simulator processes, each with its share of the peers as a service of its own (0: one per 4,000 peers)"
    )
    heartbeat_s: float = setting(1.0, "cluster scenario: the broker's --heartbeat-interval, which the peers keep", flag="--heartbeat-interval")

    @property
    def ideal_per_s(self) -> float:
        return self.workers / (self.compute_ms / 1000)

    def parts(self) -> list[Load]:
        """The loads of the simulator processes: a process's file descriptors (two a socket) bound its peers."""
        count = self.processes or max(1, math.ceil((self.ranks + self.workers) / PEERS_PER_PROCESS))
        return [
            self.model_copy(
                update={
                    "ranks": self.ranks // count + (part < self.ranks % count),
                    "workers": self.workers // count + (part < self.workers % count),
                    "processes": 1,
                }
            )
            for part in range(count)
        ]


@dataclass
class ClusterRun:
    """What a run measured; ``report()`` is its JSON."""

    load: Load
    completed: int = 0
    measured_s: float = 0.0
    waits_s: list[float] = field(default_factory=list)  # submit to dispatch at the worker
    dispatch_s: list[float] = field(default_factory=list)  # the broker's own: from when it could, to the dispatch
    duplicates: int = 0
    out_of_order: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    worker_heartbeat_bytes: int = 0  # the largest heartbeat header a worker sent
    simulator_cpu_s: float = 0.0
    submitted: int = 0
    dispatched: int = 0
    answered: int = 0

    def report(self, samples: bool = False) -> dict[str, Any]:
        """Its numbers; with ``samples`` the latencies themselves too (for ``merge``)."""
        return {
            "rate_per_s": self.completed / self.measured_s if self.measured_s else 0.0,
            "ideal_per_s": self.load.ideal_per_s,
            "wait_p50_ms": _percentile(self.waits_s, 50) * 1000,
            "wait_p99_ms": _percentile(self.waits_s, 99) * 1000,
            "dispatch_p50_ms": _percentile(self.dispatch_s, 50) * 1000,
            "dispatch_p99_ms": _percentile(self.dispatch_s, 99) * 1000,
            **({"waits_s": self.waits_s, "dispatch_s": self.dispatch_s} if samples else {}),
            "duplicates": self.duplicates,
            "out_of_order": self.out_of_order,
            "errors": self.errors,
            "worker_heartbeat_bytes": self.worker_heartbeat_bytes,
            "simulator_cpu_s": self.simulator_cpu_s,
            "measured_s": self.measured_s,
            "completed": self.completed,
            "submitted": self.submitted,
            "dispatched": self.dispatched,
            "answered": self.answered,
        }


def merge(reports: list[dict[str, Any]], load: Load) -> dict[str, Any]:
    """One report of the simulator processes' (each made with ``samples``): counts and rates added, latencies
    taken over every process's samples."""
    waits = [value for report in reports for value in report["waits_s"]]
    dispatches = [value for report in reports for value in report["dispatch_s"]]
    errors: dict[str, int] = {}
    for report in reports:
        for key, count in report["errors"].items():
            errors[key] = errors.get(key, 0) + count
    added = ("rate_per_s", "duplicates", "out_of_order", "simulator_cpu_s", "completed", "submitted", "dispatched", "answered")
    return {
        **{key: sum(report[key] for report in reports) for key in added},
        "ideal_per_s": load.ideal_per_s,
        "wait_p50_ms": _percentile(waits, 50) * 1000,
        "wait_p99_ms": _percentile(waits, 99) * 1000,
        "dispatch_p50_ms": _percentile(dispatches, 50) * 1000,
        "dispatch_p99_ms": _percentile(dispatches, 99) * 1000,
        "errors": errors,
        "worker_heartbeat_bytes": max(report["worker_heartbeat_bytes"] for report in reports),
        "measured_s": max(report["measured_s"] for report in reports),
    }


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q / 100))]
