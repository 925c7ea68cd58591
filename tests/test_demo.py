"""The demo runs the whole job (broker, two workers, a training loop) and says what it did."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from conftest import WORKER_ENV

pytestmark = pytest.mark.timeout(240)


def test_demo_runs_and_reports(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "draftfeed", "demo", "--steps", "8", "--seq-len", "64", "--workdir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=220,
        env={**os.environ, **WORKER_ENV},  # one thread a process: 2 cores shared with the rest of the suite
    )
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "model info: 8 layers, hidden 128, vocab 4096, aux layers [1, 3, 4]" in out
    assert re.search(r"done: 8 steps in [\d.]+ s: [\d.]+ steps/s, [\d,]+ tokens/s, [\d,.]+ MB of supervision", out)
    served = re.search(r"batches served per worker: \{(.*)\}", out).group(1)
    counts = [int(n) for n in re.findall(r": (\d+)", served)]
    assert len(counts) == 2 and sum(counts) == 8  # the batches, not the embeddings fetch
