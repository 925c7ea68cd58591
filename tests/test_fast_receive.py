"""reexec_with_hugepage_malloc restarts the process in place with the glibc tunable set."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(60)

SCRIPT = """
import os, sys
import draftfeed
print("start", os.getpid(), os.environ.get("GLIBC_TUNABLES"), sys.argv[1:], flush=True)
draftfeed.reexec_with_hugepage_malloc()
print("after", os.getpid(), os.environ.get("GLIBC_TUNABLES"), flush=True)
"""


def test_reexec_keeps_pid_and_arguments_and_sets_the_tunable():
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    result = subprocess.run([sys.executable, "-c", SCRIPT, "--lr", "3e-4"], capture_output=True, text=True, timeout=50, env=env)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("start") and "None" in lines[0]
    first_pid = lines[0].split()[1]
    assert lines[1] == f"start {first_pid} glibc.malloc.hugetlb=1 ['--lr', '3e-4']"
    assert lines[2] == f"after {first_pid} glibc.malloc.hugetlb=1"
    assert len(lines) == 3


def test_existing_tunables_are_kept():
    env = {**os.environ, "GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=50, env=env)
    assert result.stdout.splitlines()[-1].endswith("glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1")
