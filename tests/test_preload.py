"""Preloaded starts (tests/support/preload.py): a forked process behaves as the spawned one would, seen from
commands.start and Process: its output, its environment, its exit code, signals, its own session."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
from conftest import TESTS_DIR, WORKER_ENV
from support.lines import wait_for_line
from support.preload import PreloadedPopen

from draftfeed.processes import commands

pytestmark = pytest.mark.timeout(120)
PROBE = "preload_probe"  # tests/preload_probe.py


def started(*args: str, env: dict[str, str] | None = None) -> commands.Process:
    return commands.start(list(args), module=PROBE, env={**WORKER_ENV, **(env or {})}, ready_pattern="^probe ")


def test_a_preloaded_process_has_its_arguments_environment_session_and_exit_code():
    process = started("exit", "7", env={"PROBE_VALUE": "seen"})
    assert isinstance(process.popen, PreloadedPopen), "the suite's starts are preloaded"
    assert wait_for_line(process, r"^probe ", timeout_s=30) == f"probe argv=['exit', '7'] value=seen session={process.pid} torch=1 threads=1"
    assert process.popen.wait(30) == 7 and process.popen.poll() == 7


def test_a_signalled_process_reports_the_signal_and_a_crash_its_traceback():
    process = started("wait")
    wait_for_line(process, "^probe ", timeout_s=30)
    assert process.popen.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        process.popen.wait(0.1)
    process.popen.send_signal(signal.SIGTERM)
    assert process.popen.wait(30) == -signal.SIGTERM
    crashed = started("raise")
    assert crashed.popen.wait(30) == 1
    wait_for_line(crashed, "RuntimeError: the probe was asked to fail", timeout_s=10)


def test_another_import_time_environment_gets_a_preloader_of_its_own_and_a_prefix_spawns():
    process = started("exit", "0", env={"OMP_NUM_THREADS": "2"})  # read by OpenMP as it loads: not the first preloader's
    assert wait_for_line(process, "^probe ", timeout_s=60).endswith("torch=1 threads=2")
    assert process.popen.wait(60) == 0
    worker_like = commands.start(["exit", "0"], module=PROBE, env=WORKER_ENV, ready_pattern="^probe ", prefix=["env"])
    assert isinstance(worker_like.popen, subprocess.Popen)  # a prefix command must exec the process itself
    worker_like.popen.wait(60)


def test_the_probe_runs_as_a_plain_process_too():
    """The probe's own check, so that the preloaded answers above are compared with a spawned one."""
    env = {**os.environ, **WORKER_ENV, "PROBE_VALUE": "plain"}
    done = subprocess.run([sys.executable, "-m", PROBE, "exit", "3"], env=env, cwd=TESTS_DIR, capture_output=True, text=True, timeout=60)
    assert done.returncode == 3 and done.stdout.startswith("probe argv=['exit', '3'] value=plain session=")


def test_a_start_in_a_network_namespace_is_preloaded_and_runs_there_as_ip_netns_exec_would(hosts_available):
    """``ip netns exec NAME`` as the prefix: the forked process enters the namespace itself, and its /sys shows that
    namespace's interfaces, as the spawned command's does."""
    from draftfeed.bench.hosts import Hosts

    with Hosts(["preloaded"], subnet="10.77.0") as hosts:
        prefix = hosts.command("preloaded")
        forked = commands.start(["where"], module=PROBE, env=WORKER_ENV, ready_pattern="^probe netns=", prefix=prefix)
        assert isinstance(forked.popen, PreloadedPopen)
        line = wait_for_line(forked, "^probe netns=", timeout_s=30)
        assert forked.popen.wait(30) == 0
        env = {**os.environ, **WORKER_ENV}
        spawned = subprocess.run([*prefix, sys.executable, "-m", PROBE, "where"], env=env, cwd=TESTS_DIR, capture_output=True, text=True, timeout=60)
        assert spawned.returncode == 0, spawned.stderr
        expected = next(out for out in spawned.stdout.splitlines() if out.startswith("probe netns="))
        assert line == expected, f"preloaded: {line}; ip netns exec: {expected}"
        assert f"netns={os.stat('/proc/self/ns/net').st_ino} " not in line, "not this process's namespace"
