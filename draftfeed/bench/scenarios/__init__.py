"""The bench's scenarios by their CLI names, in the order the bench runs them. Each is a module defining
``run(quick, workdir) -> list[Row]``, imported only when run: naming them loads no torch. A scenario with settings of
its own (flags of ``draftfeed bench``) names their class ``SETTINGS`` and takes them as ``run(..., settings=)``."""

from __future__ import annotations

import importlib
from types import ModuleType

# CLI name -> module in this package
_MODULES = {
    "codec": "codec",
    "data-plane": "data_plane",
    "pair-plane": "pair_plane",
    "nixl": "nixl_plane",
    "encryption": "encryption",
    "broker": "broker",
    "cluster": "cluster",
    "overlap": "overlap",
    "scaling": "scaling",
    "real-target": "real_target",
    "tensor-parallel": "tensor_parallel",
    "automodel-sharding": "automodel_sharding",
    "long-rows": "long_rows",
    "frontier-rows": "frontier_rows",
    "store": "store",
    "weight-updates": "weight_updates",
    "speculators": "speculators",
}
SCENARIO_NAMES = tuple(_MODULES)


def load(name: str) -> ModuleType:
    """The module of the scenario called ``name`` on the command line."""
    if name not in _MODULES:
        raise ValueError(f"unknown bench scenario {name!r}; choose one of {', '.join(SCENARIO_NAMES)}")
    return importlib.import_module(f"{__name__}.{_MODULES[name]}")
