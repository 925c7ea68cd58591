"""The bench runs and reports (a smoke test: speed is shown by the bench itself, never asserted here)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time

import pytest
from conftest import WORKER_ENV

pytestmark = pytest.mark.timeout(240)


def test_bench_quick_scenarios_write_json_and_report(tmp_path):
    out = tmp_path / "bench.json"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "draftfeed",
            "bench",
            "--quick",
            "--scenario",
            "codec",
            "--scenario",
            "overlap",
            "--json",
            str(out),
            "--report",
            "--docs",
            str(tmp_path / "docs"),
        ],
        capture_output=True,
        text=True,
        timeout=220,
        env={**os.environ, **WORKER_ENV},  # one thread a process: 2 cores shared with the rest of the suite
    )
    assert result.returncode == 0, result.stdout + result.stderr
    data = json.loads(out.read_text())
    scenarios = {row["scenario"] for row in data["rows"]}
    assert scenarios == {"codec", "overlap"}
    assert all(row["value"] > 0 and row["baseline"] > 0 and row["ratio"] == pytest.approx(row["value"] / row["baseline"]) for row in data["rows"])
    assert [row["case"].split(":")[0] for row in data["rows"] if row["scenario"] == "overlap"] == [f"depth {d}" for d in (0, 1, 2, 4)]
    report = (tmp_path / "docs" / "performance.md").read_text()
    assert "| hidden (compact) |" in report and "encode" in report
    assert "ratio" in result.stdout


def test_synthetic_worker_sizes_follow_the_8b_shapes():
    from draftfeed.bench.synthetic import BYTES_PER_TOKEN, tokens_for

    assert tokens_for(312_500_000) == 2048
    assert abs(2048 * BYTES_PER_TOKEN - 312.5e6) / 312.5e6 < 0.01


def test_every_scenario_is_a_module_with_one_signature():
    import inspect

    from draftfeed.bench import SCENARIO_NAMES
    from draftfeed.bench.scenarios import load

    assert SCENARIO_NAMES == (
        "codec",
        "data-plane",
        "pair-plane",
        "nixl",
        "encryption",
        "broker",
        "cluster",
        "overlap",
        "scaling",
        "real-target",
        "tensor-parallel",
        "automodel-sharding",
        "long-rows",
        "frontier-rows",
        "store",
        "weight-updates",
        "speculators",
    )
    for name in SCENARIO_NAMES:
        module = load(name)
        own = f", settings: '{module.SETTINGS.__name__} | None' = None" if hasattr(module, "SETTINGS") else ""
        assert str(inspect.signature(module.run)) == f"(quick: 'bool', workdir: 'Path'{own}) -> 'list[Row]'", name
    with pytest.raises(ValueError, match="unknown bench scenario 'nope'"):
        load("nope")


def test_the_broker_and_the_policy_free_forwarder_route_every_request_of_the_raw_peers():
    """The broker scenario's two routed rates come from raw peers that finish only once every request was answered,
    and the CPU each router spent per request was measured: some (routing 1000 requests takes it several clock ticks
    of /proc's), and no more than its cores could give while the peers ran."""
    from draftfeed.bench.harness import probe
    from draftfeed.bench.scenarios.broker import routed_rate
    from draftfeed.processes import commands

    count = 1000

    def measured(endpoints: dict, pid: int) -> None:
        started = time.monotonic()
        rate, cpu = routed_rate(endpoints, pid, count)
        elapsed = time.monotonic() - started
        assert rate > 0 and math.isfinite(cpu), (rate, cpu)
        assert 0 < cpu * count <= elapsed * (os.cpu_count() or 1) + 0.01, f"{cpu * count:.3f} s of CPU in {elapsed:.3f} s"

    forwarder = probe(["raw-forwarder", str(count)])
    try:
        assert forwarder.stdout is not None
        measured(json.loads(forwarder.stdout.readline()), forwarder.pid)
        assert forwarder.wait(30) == 0, "the forwarder counted every done"
    finally:
        forwarder.kill()
    broker = commands.start_broker(extra=["--log-level", "WARNING"])
    try:
        measured(broker.ready, broker.pid)
    finally:
        broker.stop()


def test_every_scenario_has_a_section_of_the_report():
    from draftfeed.bench import SCENARIO_NAMES
    from draftfeed.bench.report_text import SECTIONS

    assert [section.name for section in SECTIONS] == list(SCENARIO_NAMES)


def test_docs_performance_is_the_report_of_its_own_json(tmp_path):
    """docs/performance.md is what the template renders from docs/bench-results.json, to the byte: nothing in it is
    written by hand after the run (regenerate with ``draftfeed bench --report``)."""
    from pathlib import Path

    from draftfeed.bench.harness import Row
    from draftfeed.bench.report import render

    docs = Path(__file__).resolve().parents[1] / "docs"
    data = json.loads((docs / "bench-results.json").read_text())
    rows = [Row(**{key: value for key, value in row.items() if key != "ratio"}) for row in data["rows"]]
    assert {row.scenario for row in rows} >= {"codec", "data plane", "broker", "cluster", "nixl plane", "long rows", "frontier"}
    rendered = render(rows, data["quick"], "draftfeed bench" + (" --quick" if data["quick"] else ""), tmp_path, data["machine"])
    expected, actual = (docs / "performance.md").read_text().splitlines(), rendered.read_text().splitlines()
    differing = next((index for index, (a, b) in enumerate(zip(expected, actual)) if a != b), min(len(expected), len(actual)))
    assert expected == actual, f"docs/performance.md differs from its rendering at line {differing + 1}: run draftfeed bench --report"
    assert "(not measured)" not in rendered.read_text()


def test_the_speculators_scenario_is_left_out_where_speculators_is_not_installed(tmp_path, capsys):
    import importlib.util

    from draftfeed.bench.scenarios import load

    if importlib.util.find_spec("speculators") is not None:
        pytest.skip("speculators is installed here: the scenario runs (draftfeed bench --scenario speculators)")
    assert load("speculators").run(True, tmp_path) == []
    assert "speculators left out: speculators is not installed in this environment" in capsys.readouterr().err
