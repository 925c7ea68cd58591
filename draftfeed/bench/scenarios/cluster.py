"""One broker for a cluster: simulated ranks and workers (bench/cluster/) against a real broker, and against a
policy-free forwarder of the same messages with the same peers in the same run.

The broker's main thread is pinned to the first core and the simulator's to the other, so each process's CPU says
which side ran out. Reported: requests per second against the ideal (workers / compute time), the broker's own
dispatch latency (from when a request could go, the later of its submit and the ``done`` that freed a credit, to
its dispatch at the worker) p50 and p99 against the forwarder's, how long requests queue (which Little's law fixes:
outstanding / rate), the broker's CPU per 1,000 requests against the forwarder's, its memory at the end against
after warm-up (flat: 1.0), ``draftfeed status`` against the broker under that load (goal: under a second), and
that every request was dispatched once and each rank's in order.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from draftfeed.bench.cluster import Load, merge
from draftfeed.bench.harness import Row, cpu_seconds
from draftfeed.observe.status_client import fetch_status
from draftfeed.processes import children, commands

SETTINGS = Load


def run(quick: bool, workdir: Path, settings: Load | None = None) -> list[Row]:
    load = settings or Load()
    if quick:
        load = load.model_copy(update={"warmup_s": min(load.warmup_s, 2.0), "measure_s": min(load.measure_s, 6.0)})
    broker = commands.start_broker(extra=["--log-level", "WARNING", "--heartbeat-interval", str(load.heartbeat_s)])
    try:
        measured = _measure(broker.ready, broker.pid, load, status=True)
        after = _after_byes(broker.ready["frontend"])
    finally:
        broker.stop()
    forwarder = children.spawn([sys.executable, "-m", "draftfeed.bench.cluster", "forward", str(load.heartbeat_s)], stdout=subprocess.PIPE, text=True)
    try:
        assert forwarder.stdout is not None
        baseline = _measure(json.loads(forwarder.stdout.readline()), forwarder.pid, load, status=False)
        forwarder.wait(timeout=60)
    finally:
        forwarder.kill()
    report, base = measured["report"], baseline["report"]
    shape = f"{load.ranks} ranks x {load.workers} workers at {load.compute_ms:g} ms"
    little_ms = 1000 * load.ranks * load.prefetch / max(report["rate_per_s"], 1e-9) - load.compute_ms
    wrong = report["duplicates"] + report["out_of_order"] + sum(report["errors"].values())
    rows = [
        Row(
            "cluster",
            f"requests per second, {shape}",
            report["rate_per_s"],
            report["ideal_per_s"],
            "req/s",
            "ideal (workers / compute time)",
            ">= 0.9",
        ),
        Row(
            "cluster",
            "requests per second against the policy-free forwarder's",
            report["rate_per_s"],
            base["rate_per_s"],
            "req/s",
            "forwarder, same peers",
        ),
        Row("cluster", "broker dispatch latency p50", report["dispatch_p50_ms"], base["dispatch_p50_ms"], "ms", "forwarder's p50"),
        Row("cluster", "broker dispatch latency p99", report["dispatch_p99_ms"], base["dispatch_p99_ms"], "ms", "forwarder's p99", "< 50 ms"),
        Row("cluster", "queue wait p50 (submit to dispatch)", report["wait_p50_ms"], max(little_ms, 1e-3), "ms", "Little's law: outstanding / rate"),
        Row(
            "cluster",
            "broker CPU per 1,000 requests",
            measured["cpu_per_1000_s"],
            baseline["cpu_per_1000_s"],
            "s",
            "forwarder CPU per 1,000 requests",
            "<= 0.15 s",
        ),
        Row(
            "cluster",
            "broker RSS at the end against after warm-up",
            measured["rss_end_mb"],
            measured["rss_warm_mb"],
            "MB",
            "RSS after warm-up",
            "flat",
        ),
        Row(
            "cluster",
            "pairs the broker holds at the end (they grow its memory until every one is reported)",
            float(measured.get("pairs_known", 0)),
            float(max(measured.get("pairs_reported", 0), 1)),
            "pairs",
            "pairs the workers have",
        ),
        Row("cluster", "draftfeed status under that load (the summary)", measured["status_summary_s"], 1.0, "s", "a second", "< 1 s"),
        Row("cluster", "draftfeed status under that load (every worker and rank)", measured["status_full_s"], 1.0, "s", "a second"),
        Row("cluster", "simulator CPU per request", 1e6 * report["simulator_cpu_s"] / max(report["answered"], 1), 200.0, "us", "the issue's 200 us"),
        Row("cluster", "requests dispatched twice or out of order, and errors peers heard", float(wrong), 1.0, "count", "none (1 shown)", "0"),
        Row(
            "cluster",
            "ranks and workers the broker holds after all said bye",
            float(after["rank_count"] + after["worker_count"]),
            float(load.ranks + load.workers),
            "peers",
            "peers it held",
            "0",
        ),
    ]
    return rows


def _measure(endpoints: dict, pid: int, load: Load, status: bool) -> dict:
    """Run the simulator processes against the router at ``endpoints`` (process ``pid``): their merged report, the
    router's CPU per 1,000 requests and memory, and (``status``) how long ``draftfeed status`` takes in the middle."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) > 1:
        os.sched_setaffinity(pid, {cores[0]})  # the router's main thread: its own core
    sims = [
        children.spawn(
            [
                sys.executable,
                "-m",
                "draftfeed.bench.cluster",
                "simulate",
                endpoints["frontend"],
                endpoints["backend"],
                part.model_dump_json(),
                str(index),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for index, part in enumerate(load.parts())
    ]
    try:
        for sim in sims:
            if len(cores) > 1:
                os.sched_setaffinity(sim.pid, {cores[-1]})
        for sim in sims:
            assert sim.stdout is not None
            json.loads(sim.stdout.readline())  # started: its peers connected
        cpu_start, result = cpu_seconds(pid), {}
        for sim in sims:
            assert sim.stdin is not None
            sim.stdin.write("go\n")
            sim.stdin.flush()
        sampler = threading.Thread(target=_sample, args=(endpoints, pid, load, status, result), daemon=True)
        sampler.start()
        reports = [json.loads(sim.stdout.readline()) for sim in sims]  # type: ignore[union-attr]
        cpu = cpu_seconds(pid) - cpu_start
        sampler.join(timeout=60)
        for sim in sims:
            sim.wait(timeout=60)
    finally:
        for sim in sims:
            sim.kill()
    report = merge(reports, load)
    return {"report": report, "cpu_per_1000_s": 1000 * cpu / max(report["answered"], 1), **result}


def _sample(endpoints: dict, pid: int, load: Load, status: bool, result: dict) -> None:
    """The router's RSS after warm-up and near the end, and the status query's time, while the run goes on."""
    time.sleep(load.warmup_s)
    result["rss_warm_mb"] = _rss_mb(pid)
    if status:
        started = time.monotonic()
        fetch_status(endpoints["frontend"], summary=True)
        result["status_summary_s"] = time.monotonic() - started
        started = time.monotonic()
        fetch_status(endpoints["frontend"], pairs=False)
        result["status_full_s"] = time.monotonic() - started
    time.sleep(max(0.0, load.measure_s - 2.0))
    result["rss_end_mb"] = _rss_mb(pid)
    if status:
        workers = [w for service in fetch_status(endpoints["frontend"], pairs=False)["services"].values() for w in service["workers"]]
        result["pairs_known"] = sum(sum(w["planes"].values()) for w in workers)
        result["pairs_reported"] = sum(w["pair_count"] for w in workers)


def _after_byes(frontend: str, timeout_s: float = 30.0) -> dict:
    """The broker's summary once it holds no peer, or after ``timeout_s`` (as it is then)."""
    deadline = time.monotonic() + timeout_s
    while True:
        summary = fetch_status(frontend, summary=True)
        if summary["rank_count"] + summary["worker_count"] == 0 or time.monotonic() > deadline:
            return summary
        time.sleep(0.2)


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0
