"""The import graph's rules (docs/architecture.md, "Package layout"), checked on the code itself.

Runtime checks start a fresh interpreter and look at ``sys.modules``; static checks read every import
statement of the package (module level and inside functions) with ``ast``.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).parent.parent / "draftfeed"
HEAVY = ("torch", "transformers", "numpy")


def modules_after(code: str) -> set[str]:
    """The top-level names of every module loaded after running ``code`` in a fresh interpreter."""
    probe = f"{code}\nimport sys, json\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True).stdout
    return set(json.loads(out.strip().splitlines()[-1]))


@pytest.mark.parametrize(
    "what, code",
    [
        ("the broker", "import draftfeed.broker.broker"),
        ("the broker's health and metrics", "import draftfeed.observe.http, draftfeed.observe.broker_metrics"),
        (
            "`draftfeed launch broker --help`",
            "from draftfeed.launch.cli import main\ntry:\n    main(['launch', 'broker', '--help'])\nexcept SystemExit:\n    pass",
        ),
        ("`import draftfeed`", "import draftfeed"),
        ("the wire layer", "import draftfeed.schemas.frames, draftfeed.schemas.messages, draftfeed.schemas.tensor_specs, draftfeed.schemas.protocol"),
        ("`draftfeed status`'s module", "import draftfeed.observe.status_client"),
        ("the bench's scenario names", "import draftfeed.bench"),
        ("the integrations package", "import draftfeed.integrations"),
    ],
)
def test_loads_no_torch(what, code):
    loaded = modules_after(code)
    heavy = [name for name in HEAVY if name in loaded]
    assert not heavy, f"{what} loads {', '.join(heavy)}"


def test_the_public_names_load_on_first_use():
    loaded = modules_after("import draftfeed\nassert draftfeed.RemoteEagle3Target.__name__ == 'RemoteEagle3Target'")
    assert "torch" in loaded and "draftfeed.producers.tasks.base" in loaded
    with pytest.raises(AttributeError, match="has no attribute 'Nope'"):
        import draftfeed

        draftfeed.Nope  # noqa: B018


def test_the_nemo_adapter_loads_nemo_only_when_used():
    """NeMo comes in with use_draftfeed() or DraftfeedEagle3TargetModel(...), never with an import of draftfeed."""
    loaded = modules_after(
        "import draftfeed, draftfeed.integrations, draftfeed.integrations.nemo\nfrom draftfeed.integrations.nemo import use_draftfeed"
    )
    assert "draftfeed.integrations.nemo" in loaded
    nemo = sorted(name for name in loaded if name.startswith("nemo"))
    assert not nemo, f"importing draftfeed.integrations.nemo loads {', '.join(nemo)}"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """Every draftfeed module ``path`` imports, at module level or inside a function, resolved to module names."""
    found: set[str] = set()
    here = module_name(path)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base]) if base else ".".join(anchor)
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    modules = {module_name(p) for p in PACKAGE.rglob("*.py")}
    return {name for name in found if name in modules and name != here}


GRAPH = {module_name(p): imports_of(p) for p in PACKAGE.rglob("*.py")}


@pytest.mark.parametrize("side, other", [("draftfeed.producers", "draftfeed.consumers"), ("draftfeed.consumers", "draftfeed.producers")])
def test_the_rank_side_and_the_worker_side_never_import_each_other(side, other):
    theirs = "worker" if side == "draftfeed.producers" else "rank"
    crossing = sorted(f"{m} -> {i}" for m, imported in GRAPH.items() if m.startswith(side) for i in imported if side_of(i) == theirs)
    assert not crossing, "\n".join(crossing)


def side_of(module: str) -> str | None:
    """Which side a module is: the rank's (producers/, and each data plane's rank half), the worker's (consumers/,
    and each data plane's worker half), or neither (what both share)."""
    if module.startswith("draftfeed.producers"):
        return "rank"
    if module.startswith("draftfeed.consumers"):
        return "worker"
    if module.startswith("draftfeed.dataplane."):
        leaf = module.rsplit(".", 1)[1]
        if leaf.startswith("rank"):
            return "rank"
        if leaf.startswith("worker"):
            return "worker"
    return None


def test_each_data_planes_rank_half_and_worker_half_never_import_each_other():
    """A data plane lives in one folder (dataplane/<plane>/): what both sides share, the rank's half (rank*.py) and
    the worker's half (worker*.py); neither half, nor what both share, imports the other side's."""
    crossing = []
    for module, imported in GRAPH.items():
        if not module.startswith("draftfeed.dataplane"):
            continue
        mine = side_of(module)
        for name in imported:
            theirs = side_of(name)
            if theirs is not None and theirs != mine:
                crossing.append(f"{module} ({mine or 'shared'}) -> {name} ({theirs})")
    assert not crossing, "\n".join(sorted(crossing))
    sides = {side_of(module) for module in GRAPH if module.startswith("draftfeed.dataplane")}
    assert sides == {None, "rank", "worker"}


def test_the_store_imports_neither_side():
    """store/ is the rank's, used through producers/stored.py, but imports neither producers/ nor consumers/."""
    crossing = sorted(
        f"{m} -> {i}"
        for m, imported in GRAPH.items()
        if m.startswith("draftfeed.store")
        for i in imported
        if i.startswith(("draftfeed.producers", "draftfeed.consumers"))
    )
    assert not crossing, "\n".join(crossing)


def heavy_imports(path: Path) -> set[str]:
    """The heavy packages (torch, transformers, numpy) ``path`` imports itself, anywhere in the file."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names.add(node.module.split(".")[0])
    return names & set(HEAVY)


def test_the_wire_layer_and_the_broker_need_no_torch():
    """schemas/ and broker/ import no heavy package, nor a draftfeed module outside the torch-free ones."""
    torch_free = ("draftfeed.schemas", "draftfeed.broker", "draftfeed.security", "draftfeed.logs", "draftfeed.net")
    problems = []
    for path in PACKAGE.rglob("*.py"):
        name = module_name(path)
        if not name.startswith(("draftfeed.schemas", "draftfeed.broker")):
            continue
        problems += [f"{name} imports {heavy}" for heavy in sorted(heavy_imports(path))]
        problems += [f"{name} -> {i}" for i in sorted(GRAPH[name]) if not i.startswith(torch_free) and i != "draftfeed"]
    assert not problems, "\n".join(problems)


def test_no_import_circles():
    package_inits = {m for m in GRAPH if (PACKAGE.parent / m.replace(".", "/") / "__init__.py").exists()}
    edges = {m: {i for i in imported if i not in package_inits} for m, imported in GRAPH.items()}
    circles: list[list[str]] = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                circles.append([*stack[stack.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node)
    assert not circles, "\n".join(" -> ".join(c) for c in circles)


def test_the_bench_stands_apart_from_the_launch_commands():
    """launch/ may run the bench; bench/ drives the project through its commands and the shared process helpers
    (draftfeed/processes/), never through launch/'s modules."""
    crossing = sorted(
        f"{m} -> {i}" for m, imported in GRAPH.items() if m.startswith("draftfeed.bench") for i in imported if i.startswith("draftfeed.launch")
    )
    assert not crossing, "\n".join(crossing)
