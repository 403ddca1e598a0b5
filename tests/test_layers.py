"""The layers of docs/architecture.md, checked on the imports.

Every module under adapters/, mtplxd/ and engine/ is read (not imported) and each of its
imports, at the top, inside functions or under TYPE_CHECKING alike, becomes an arrow
between two modules. Each module has one place (`LAYERS`, `VOCABULARY`), each place the
places it may import (`MAY_IMPORT`); the rules are the document's:

- the adapters import only the runtime, the requests and settings, and the engine's
  MLX-free vocabulary (never the scheduler, the daemon core, the CLI side or the engine);
- the daemon core imports nothing from the CLI side, the adapters, the runtime or the daemon;
- only mtplxd/daemon.py (and the CLI side) imports the adapters; nothing imports the CLI side;
- the engine imports no daemon, no adapter, nothing of mtplxd; the vocabulary only itself;
  the model store nothing of the project;
- the vocabulary, the requests and settings, the adapters and the model store never
  import mlx or mlx_lm, not even inside a function;
- no circles: no module reaches itself through the imports that run (those inside
  functions included; annotation-only ones under TYPE_CHECKING aside);
- the map (docs/architecture.md) names every folder.

An arrow that breaks a rule in a file whose owner has still to change it is listed in
`KNOWN_EXCEPTIONS` (a circle in `KNOWN_CIRCLES`), with the fix; an entry that no longer occurs fails too, so the list
only shrinks. Besides the static check, a subprocess imports the adapters and watches
which modules load: no MLX, no scheduler (the runtime keeps them to annotations).
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("adapters", "mtplxd", "engine")
MLX = ("mlx", "mlx_lm")

# The engine modules anyone may import: plain Python over the tokenizer and settings,
# no MLX (the package's __init__ sets up BLAS, without mlx).
VOCABULARY = frozenset({
    "engine", "engine.blas", "engine.prompts", "engine.tool_prompts", "engine.sampler_settings",
    "engine.profiles",
})

# Module or package -> its place; the longest matching name wins. A module that matches
# none fails the test: place it here and in docs/architecture.md.
LAYERS = {
    "adapters": "adapters",
    "mtplxd.runtime": "runtime",
    "mtplxd.requests": "requests",
    "mtplxd.config": "requests",
    "mtplxd.state_dir": "requests",
    "mtplxd.scheduler": "core",
    "mtplxd.jobs": "core",
    "mtplxd.shares": "core",
    "mtplxd.workspaces": "core",
    "mtplxd.calibrate": "core",
    "mtplxd.loader": "core",
    "mtplxd.ranks": "core",
    "mtplxd.daemon": "daemon",
    "mtplxd.__main__": "cli",
    "mtplxd.cli": "cli",
    "mtplxd.client": "cli",
    "mtplxd.commands": "cli",
    "mtplxd.bench": "cli",
    "mtplxd.shims": "cli",
    "mtplxd.store": "store",
    "engine": "engine",
}

PLACES = ("adapters", "runtime", "requests", "core", "daemon", "cli", "store", "engine", "vocabulary")
MAY_IMPORT = {
    "adapters": {"adapters", "runtime", "requests", "vocabulary"},
    "runtime": {"runtime", "requests", "core", "engine", "vocabulary"},
    "requests": {"requests", "store", "vocabulary"},
    "core": {"core", "requests", "store", "engine", "vocabulary"},
    "daemon": {"daemon", "adapters", "runtime", "requests", "core", "store", "engine", "vocabulary"},
    "cli": set(PLACES),
    "store": {"store"},
    "engine": {"engine", "vocabulary"},
    "vocabulary": {"vocabulary"},
}
MLX_FREE = {"adapters", "requests", "store", "vocabulary"}

# (importer, imported) -> the change that removes the arrow, in files their owners are
# editing now. Keep this list short; it may only shrink.
KNOWN_EXCEPTIONS: dict[tuple[str, str], str] = {}
# Circles -> the change that breaks them.
KNOWN_CIRCLES: dict[frozenset[str], str] = {}


# -- reading the imports -------------------------------------------------------------------


def module_name(path: Path, root: Path) -> str:
    return ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")


def project_modules(root: Path = ROOT, packages: Iterable[str] = PACKAGES) -> dict[str, Path]:
    """Module name -> file; a package's __init__ that imports nothing (a docstring, a
    marker) is no module of its own here: importing from the package names a submodule."""
    return {module_name(p, root): p for top in packages for p in sorted((root / top).rglob("*.py"))
            if "__pycache__" not in p.parts and not (p.name == "__init__.py" and not _imports_anything(p))}


def _imports_anything(path: Path) -> bool:
    return any(isinstance(n, (ast.Import, ast.ImportFrom)) for n in ast.walk(ast.parse(path.read_text())))


@dataclass
class Graph:
    """The project's imports: `arrows` all of them; `run_arrows` those that run (top level
    or inside functions; not the annotations under TYPE_CHECKING); `mlx` the MLX packages
    each module imports."""

    arrows: dict[str, set[str]]
    run_arrows: dict[str, set[str]] = field(default_factory=dict)
    mlx: dict[str, set[str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.run_arrows = self.run_arrows or {m: set(t) for m, t in self.arrows.items()}
        self.mlx = {m: set() for m in self.arrows} | self.mlx


def imported_names(module: str, path: Path) -> dict[str, bool]:
    """Every name `module` imports, absolute, wherever the import statement sits ->
    whether it is imported only for annotations (under `if TYPE_CHECKING:`)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    tree = ast.parse(path.read_text(), str(path))
    typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If) and _is_type_checking(block.test)
                   for statement in block.body for n in ast.walk(statement)}
    names: dict[str, bool] = {}
    for node in ast.walk(tree):
        found: list[str] = []
        if isinstance(node, ast.Import):
            found = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, *([node.module] if node.module else [])])
            found = [f"{base}.{alias.name}" if alias.name != "*" else base for alias in node.names]
        for name in found:
            names[name] = names.get(name, True) and id(node) in typing_only
    return names


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def import_graph(modules: Mapping[str, Path]) -> Graph:
    graph = Graph({})
    for module, path in modules.items():
        names = imported_names(module, path)
        graph.arrows[module], graph.run_arrows[module] = set(), set()
        for name, typing_only in names.items():
            # `from pkg import name`: the submodule pkg.name if there is one, else pkg
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name != module:
                graph.arrows[module].add(name)
                if not typing_only:
                    graph.run_arrows[module].add(name)
        graph.mlx[module] = {n for n in names if n.split(".")[0] in MLX}
    return graph


def place_of(module: str) -> str:
    """The module's place; "unplaced" when LAYERS has none for it (it then may import nothing)."""
    if module in VOCABULARY:
        return "vocabulary"
    matches = [name for name in LAYERS if module == name or module.startswith(name + ".")]
    return LAYERS[max(matches, key=len)] if matches else "unplaced"


def places(modules: Iterable[str]) -> dict[str, str]:
    return {m: place_of(m) for m in modules}


# -- the rules -----------------------------------------------------------------------------


def wrong_arrows(graph: Graph, place: Mapping[str, str]) -> set[tuple[str, str]]:
    """The (importer, imported) pairs whose places may not meet that way."""
    return {(a, b) for a, targets in graph.arrows.items() for b in targets
            if place[b] not in MAY_IMPORT.get(place[a], set())}


def mlx_users(graph: Graph, place: Mapping[str, str]) -> set[str]:
    return {m for m, names in graph.mlx.items() if names and place[m] in MLX_FREE}


def circles(graph: Mapping[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative).
    Run with `Graph.run_arrows`: two modules that name each other's types only for
    annotations are no circle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(frozenset(component))
    return found


def broken_rules(graph: Graph, place: Mapping[str, str]) -> list[str]:
    """One line per broken rule, the known exceptions left out."""
    lines = [f"{a} ({place[a]}) imports {b} ({place[b]})" for a, b in sorted(wrong_arrows(graph, place))
             if (a, b) not in KNOWN_EXCEPTIONS]
    lines += [f"{m} ({place[m]}) imports {', '.join(sorted(graph.mlx[m]))}" for m in sorted(mlx_users(graph, place))]
    lines += [f"a circle: {' <-> '.join(sorted(c))}" for c in circles(graph.run_arrows) if c not in KNOWN_CIRCLES]
    return lines


@pytest.fixture(scope="module")
def project() -> tuple[dict[str, Path], Graph]:
    modules = project_modules()
    return modules, import_graph(modules)


def test_every_module_has_a_place(project):
    modules, _ = project
    assert len(modules) > 100  # the walk found the project
    assert [m for m in modules if place_of(m) == "unplaced"] == []


def test_the_imports_keep_the_layers(project):
    modules, graph = project
    assert broken_rules(graph, places(modules)) == [], "see docs/architecture.md for the rules and where things go"


def test_the_known_exceptions_still_occur(project):
    """A fixed exception leaves the list: the list only shrinks."""
    modules, graph = project
    wrong = wrong_arrows(graph, places(modules))
    fixed = [arrow for arrow in KNOWN_EXCEPTIONS if arrow not in wrong]
    assert fixed == [], "fixed: remove these from KNOWN_EXCEPTIONS"
    broken = [sorted(c) for c in KNOWN_CIRCLES if c not in circles(graph.run_arrows)]
    assert broken == [], "broken: remove these from KNOWN_CIRCLES"
    assert len(KNOWN_EXCEPTIONS) + len(KNOWN_CIRCLES) <= 3  # no new exceptions: fix the import instead


def test_the_map_names_every_folder():
    """docs/architecture.md has a line for each folder of the code (kept true here)."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    folders = sorted({p.parent.relative_to(ROOT).as_posix() for top in PACKAGES for p in (ROOT / top).rglob("*.py")
                      if "__pycache__" not in p.parts})
    assert [f for f in folders if f"{f}/" not in text] == []


# -- negative controls ---------------------------------------------------------------------


def test_the_checker_reports_each_kind_of_broken_rule():
    """A synthetic project that breaks every rule once: each break is reported."""
    graph = Graph({
        "adapters.http.app": {"mtplxd.scheduler"},  # an adapter reaching the queue's insides
        "mtplxd.calibrate": {"mtplxd.bench.decode"},  # the core reaching the CLI side
        "engine.engine": {"mtplxd.requests"},  # the engine knowing the daemon
        "engine.profiles": {"engine.sessions.arrays"},  # the vocabulary reaching MLX code
        "mtplxd.ranks.leader": {"mtplxd.daemon"},  # a circle, and the core reaching the daemon
        "mtplxd.daemon": {"mtplxd.ranks.leader"},
        "mtplxd.scheduler": set(), "mtplxd.bench.decode": set(), "mtplxd.requests": set(),
        "engine.sessions.arrays": set(),
    }, mlx={"adapters.http.app": {"mlx.core"}})
    place = places(graph.arrows)
    assert "unplaced" not in place.values()
    broken = broken_rules(graph, place)
    assert broken == [
        "adapters.http.app (adapters) imports mtplxd.scheduler (core)",
        "engine.engine (engine) imports mtplxd.requests (requests)",
        "engine.profiles (vocabulary) imports engine.sessions.arrays (engine)",
        "mtplxd.calibrate (core) imports mtplxd.bench.decode (cli)",
        "mtplxd.ranks.leader (core) imports mtplxd.daemon (daemon)",
        "adapters.http.app (adapters) imports mlx.core",
        "a circle: mtplxd.daemon <-> mtplxd.ranks.leader",
    ]
    allowed = Graph({"adapters.http.app": {"mtplxd.runtime", "engine.prompts"}, "mtplxd.runtime": set(),
                     "engine.prompts": set()})
    assert broken_rules(allowed, places(allowed.arrows)) == []


def test_the_reader_finds_imports_inside_functions_and_relative_ones(tmp_path):
    """A module written to disk: an import inside a function, a relative one and one
    under TYPE_CHECKING are all arrows."""
    core = tmp_path / "mtplxd"
    (core / "bench").mkdir(parents=True)
    for path in (core / "__init__.py", core / "bench" / "__init__.py", core / "bench" / "decode.py",
                 core / "requests.py", core / "runtime.py"):
        path.write_text("")
    (core / "calibrate.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "from . import requests\n"
        "if TYPE_CHECKING:\n    from mtplxd.runtime import Runtime\n"
        "def prompts():\n    from mtplxd.bench.decode import held_out_prompts\n    import mlx.core as mx\n"
    )
    graph = import_graph(project_modules(tmp_path, ["mtplxd"]))
    assert graph.arrows["mtplxd.calibrate"] == {"mtplxd.requests", "mtplxd.runtime", "mtplxd.bench.decode"}
    assert graph.run_arrows["mtplxd.calibrate"] == {"mtplxd.requests", "mtplxd.bench.decode"}
    assert graph.mlx["mtplxd.calibrate"] == {"mlx.core"}
    assert broken_rules(graph, places(graph.arrows)) == [
        "mtplxd.calibrate (core) imports mtplxd.bench.decode (cli)",
        "mtplxd.calibrate (core) imports mtplxd.runtime (runtime)",
    ]


# -- what importing the adapters loads -------------------------------------------------------

PROBE = """
import importlib, json, sys
for name in sys.argv[1:]:
    importlib.import_module(name)
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in ("mlx", "mlx_lm", "engine")
                        or m == "mtplxd.scheduler" or m == "mtplxd.jobs")))
"""


def _loaded_by(modules: list[str]) -> set[str]:
    out = subprocess.run([sys.executable, "-c", PROBE, *modules], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, check=True)
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


def _adapter_modules() -> list[str]:
    return sorted(m for m in project_modules(ROOT, ["adapters"]))


def test_adapters_import_neither_mlx_nor_the_scheduler():
    modules = _adapter_modules()
    assert len(modules) > 20  # the walk found the adapters
    loaded = _loaded_by([*modules, "mtplxd.runtime", "mtplxd.requests"])
    assert loaded - VOCABULARY == set()


def test_the_probe_sees_mlx_when_a_module_loads_it():
    """Negative control: the scheduler runs the engine, so importing it loads mlx."""
    loaded = _loaded_by(["mtplxd.scheduler"])
    assert {"mlx.core", "mtplxd.scheduler", "engine.engine"} <= loaded
