"""NeMo AutoModel for the tests that compare with it or drive its recipes.

NeMo and the packages its recipes import (torchao, datasets, ...) are installed apart from the venv, in .nemo-packages
(the Makefile: pip --target, --no-deps), and put on the path only by the tests that use them: with torchao importable,
transformers loads it in every process that loads a model, every worker of the suite included.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

NEMO_PACKAGES = Path(__file__).resolve().parents[2] / ".nemo-packages"


def nemo_on_path() -> None:
    """Put .nemo-packages on this process's path, after the venv's own packages; skip the test if NeMo is not there."""
    if str(NEMO_PACKAGES) not in sys.path:
        sys.path.append(str(NEMO_PACKAGES))
    if importlib.util.find_spec("nemo_automodel") is None:
        pytest.skip(f"nemo-automodel is not installed in {NEMO_PACKAGES} (`make venv` installs it: nemo-automodel 0.7.0, --no-deps)")
