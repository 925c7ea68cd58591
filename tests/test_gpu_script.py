"""benchmarks/gpu.py stays runnable without a GPU: its --small mode runs every measurement on the CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import WORKER_ENV

pytestmark = pytest.mark.timeout(240)
SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu.py"


@pytest.mark.long  # benchmarks/gpu.py at a small shape on CPU, to keep it runnable for a GPU session: make test-long
def test_gpu_script_small_on_cpu(tmp_path):
    out = tmp_path / "gpu.json"
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--small", "--device", "cpu", "--pipeline-forms", "hidden", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=220,
        env={**os.environ, **WORKER_ENV},  # one thread a process: 2 cores shared with the rest of the suite
    )
    assert result.returncode == 0, result.stdout + result.stderr
    data = json.loads(out.read_text())
    assert data["shape"] == "small" and data["forward_ms"] > 0
    assert data["compact"]["position_mask_equal"] is True
    assert data["compact"]["bytes_ratio_vs_probs"] > 4
    # One form end to end is enough to keep the pipeline part runnable; the suite's own tests cover both forms.
    assert "batch_ms" in data["pipeline"]["hidden"], data["pipeline"]
