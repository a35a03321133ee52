"""No import cycle in services/, between packages or between modules.

The graph is read with ``ast`` from the sources, not from ``sys.modules``: every
``import``/``from … import`` counts wherever it stands (module level, inside a function,
under ``if TYPE_CHECKING:``), because a cycle a lazy or type-only import hides is still a
cycle in the design: the two ends cannot be understood, tested or moved apart. An import
by name at run time (``importlib.import_module``, as ``services/cli/serve.py`` starts a
``serve`` command) is no statement and is not seen.

- A *package* is a directory with ``__init__.py``. An import adds the edge package of the
  importing module → package of the imported module; a package importing its own
  subpackage counts (``services.index`` → ``services.index.core``), so a subpackage that
  imports back from its parent closes a cycle. Imports inside one package are no edge.
- A *module* is one ``.py`` file (a package's ``__init__.py`` is the package's module).
  ``from p import name`` points at ``p.name`` when that is a module, else at ``p``.

A failure prints each cycle with the import line behind every edge.

Between the *top-level* packages (``services.X``, every subpackage folded into its X) there
is no cycle either, and the imports go down the layers of :data:`LAYERS` (issue #32). The
only exceptions are the imports of :data:`KNOWN`, each tied to the files it may come from;
an entry whose imports are gone fails too, so the list can only shrink.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOP = "services"


@dataclass(frozen=True)
class Import:
    """One import statement's target: where it stands and which module it names."""

    source: str
    target: str
    where: str


def module_files(root: Path, top: str) -> dict[str, Path]:
    """Dotted module name → file, for every module of the ``top`` package under ``root``."""
    modules: dict[str, Path] = {}
    for path in sorted((root / top).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if not all(
            (root.joinpath(*parts[:i]) / "__init__.py").is_file() for i in range(1, len(parts))
        ):
            continue  # a script in a folder that is no package is not importable as services.…
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _is_package(name: str, modules: Mapping[str, Path]) -> bool:
    return name in modules and modules[name].name == "__init__.py"


def package_of(name: str, modules: Mapping[str, Path]) -> str:
    """The package a module belongs to (a package's ``__init__`` belongs to the package)."""
    return name if _is_package(name, modules) else name.rpartition(".")[0]


def _known(name: str, modules: Mapping[str, Path]) -> str | None:
    """The longest prefix of ``name`` that is one of our modules (``a.b.func`` → ``a.b``)."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in modules:
            return candidate
    return None


def imports_of(name: str, modules: Mapping[str, Path], root: Path) -> list[Import]:
    """Every import of one of our modules that ``name``'s source makes, anywhere in it."""
    path = modules[name]
    tree = ast.parse(path.read_text(), filename=str(path))
    here = package_of(name, modules)
    found: list[Import] = []
    for node in ast.walk(tree):
        where = f"{path.relative_to(root)}:{getattr(node, 'lineno', 0)}"
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = here.split(".")
                base = ".".join(base_parts[: len(base_parts) - (node.level - 1)])
                stem = f"{base}.{node.module}" if node.module else base
            else:
                stem = node.module or ""
            targets = [f"{stem}.{alias.name}" for alias in node.names]
        for target in targets:
            known = _known(target, modules)
            if known is not None and known != name:
                found.append(Import(name, known, where))
    return found


@dataclass(frozen=True)
class Cycle:
    """A strongly connected component of the graph: one shortest cycle through its first
    node, and every edge inside it (from, to, where), so one run shows all there is to cut."""

    path: list[str]
    edges: list[tuple[str, str, str]]


def cycles(edges: Iterable[tuple[str, str, str]]) -> list[Cycle]:
    """One :class:`Cycle` per strongly connected component with more than one node.

    ``edges`` are (from, to, where); the first ``where`` seen for an edge is kept. Tarjan's
    algorithm finds the components; a breadth-first search inside each from its smallest
    node back to itself gives the cycle to print first.
    """
    graph: dict[str, dict[str, str]] = {}
    for a, b, where in edges:
        if a != b:
            graph.setdefault(a, {}).setdefault(b, where)
            graph.setdefault(b, {})
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)

    for root in sorted(graph):
        if root in index:
            continue
        # Iterative Tarjan: recursion depth is not ours to spend.
        visit(root)
        work = [(root, iter(sorted(graph[root])))]
        while work:
            current, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    visit(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[current] = min(low[current], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[current])
            if low[current] == index[current]:
                component: list[str] = []
                while not component or component[-1] != current:
                    component.append(stack.pop())
                    on_stack.discard(component[-1])
                if len(component) > 1:
                    components.append(sorted(component))

    found: list[Cycle] = []
    for component in sorted(components):
        members = set(component)
        start = component[0]
        previous: dict[str, str] = {}
        frontier = [start]
        while start not in previous:
            following: list[str] = []
            for node in frontier:
                for child in sorted(graph[node]):
                    if child in members and child not in previous:
                        previous[child] = node
                        following.append(child)
            frontier = following
        path = [start]
        while len(path) == 1 or path[-1] != start:
            path.append(previous[path[-1]])
        path.reverse()
        inside = [(a, b, graph[a][b]) for a in component for b in sorted(graph[a]) if b in members]
        found.append(Cycle(path, inside))
    return found


def describe(found: list[Cycle]) -> str:
    lines: list[str] = []
    for cycle in found:
        lines.append(" -> ".join(cycle.path))
        lines.extend(f"    {a} -> {b}  ({where})" for a, b, where in cycle.edges)
    return "\n".join(lines)


@functools.lru_cache(maxsize=8)
def _graph(root: Path, top: str) -> tuple[dict[str, Path], list[Import]]:
    """Every module of ``top`` and every import between them, read once per tree: the tests
    of this module all ask for the same graph of services/."""
    modules = module_files(root, top)
    return modules, [edge for name in modules for edge in imports_of(name, modules, root)]


def package_cycles(root: Path, top: str = TOP) -> list[Cycle]:
    modules, found = _graph(root, top)
    return cycles(
        (package_of(i.source, modules), package_of(i.target, modules), i.where) for i in found
    )


def module_cycles(root: Path, top: str = TOP) -> list[Cycle]:
    _, found = _graph(root, top)
    return cycles((i.source, i.target, i.where) for i in found)


def test_no_package_cycle_in_services() -> None:
    found = package_cycles(ROOT)
    if found:
        pytest.fail("package import cycles in services/:\n" + describe(found), pytrace=False)


def test_no_module_cycle_in_services() -> None:
    found = module_cycles(ROOT)
    if found:
        pytest.fail("module import cycles in services/:\n" + describe(found), pytrace=False)


def _write(root: Path, files: Mapping[str, str]) -> None:
    for relative, text in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_a_lazy_import_back_from_a_subpackage_is_a_package_cycle(tmp_path: Path) -> None:
    _write(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/a/__init__.py": "",
            "pkg/a/top.py": "from pkg.a.sub import leaf\n",
            "pkg/a/sub/__init__.py": "",
            "pkg/a/sub/leaf.py": "def f() -> None:\n    from ..top import x\n",
        },
    )
    assert describe(package_cycles(tmp_path, "pkg")) == (
        "pkg.a -> pkg.a.sub -> pkg.a\n"
        "    pkg.a -> pkg.a.sub  (pkg/a/top.py:1)\n"
        "    pkg.a.sub -> pkg.a  (pkg/a/sub/leaf.py:2)"
    )


def test_a_type_checking_import_closes_a_module_cycle(tmp_path: Path) -> None:
    _write(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/one.py": "import pkg.two\n",
            "pkg/two.py": (
                "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import one\n"
            ),
        },
    )
    assert package_cycles(tmp_path, "pkg") == []
    assert describe(module_cycles(tmp_path, "pkg")) == (
        "pkg.one -> pkg.two -> pkg.one\n"
        "    pkg.one -> pkg.two  (pkg/one.py:1)\n"
        "    pkg.two -> pkg.one  (pkg/two.py:3)"
    )


def test_an_acyclic_tree_passes(tmp_path: Path) -> None:
    _write(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/low.py": "import json\n",
            "pkg/high/__init__.py": "from pkg import low\n",
            "pkg/high/use.py": "from pkg.high import helper\nfrom .. import low\n",
            "pkg/high/helper.py": "from pkg.low import thing\n",
        },
    )
    assert package_cycles(tmp_path, "pkg") == []
    assert module_cycles(tmp_path, "pkg") == []


# --- top-level packages: no cycle, and the layer order --------------------------------------

# Bottom → top; a package imports from its own layer or lower ones only. ``common`` holds
# the shared words (no I/O), ``process`` a process's host plumbing (logging, Redis, CPU
# sets) and ``telemetry`` its tracer (no grpc), ``rpc`` the gRPC plumbing every server and
# client uses. ``measures`` has
# nothing above ``common`` (ranking measures, contrastive entropy), so the encoder's training
# and ``eval`` share it; ``generations`` owns index generations and sits below the gateway,
# which reads its registry.
LAYERS: tuple[frozenset[str], ...] = (
    frozenset({"common"}),
    frozenset({"process", "telemetry"}),
    frozenset({"rpc"}),
    frozenset({"corpus", "measures"}),
    frozenset({"index", "encoder", "rerank"}),
    frozenset({"eval", "client"}),
    frozenset({"tune"}),
    frozenset({"generations"}),
    frozenset({"gateway"}),
    frozenset({"plan", "stack", "cli"}),
)


@dataclass(frozen=True)
class Known:
    """A still-allowed import between two top-level packages, from ``files`` only (a path
    relative to the repository; one ending in ``/`` is a folder)."""

    files: tuple[str, ...]
    why: str


# Empty since the generations package landed (issue #32); an entry here names an import
# that runs against the layers on purpose, the files it may come from, and why.
KNOWN: dict[tuple[str, str], Known] = {}


def top_level(name: str, top: str) -> str:
    """``services.index.core.shard`` → ``services.index``."""
    return ".".join(name.split(".")[: len(top.split(".")) + 1])


def _file_of(where: str) -> str:
    return where.rpartition(":")[0]


def _allowed(edge: tuple[str, str], where: str, known: Mapping[tuple[str, str], Known]) -> bool:
    entry = known.get(edge)
    if entry is None:
        return False
    path = _file_of(where)
    return any(path == f or (f.endswith("/") and path.startswith(f)) for f in entry.files)


def top_level_imports(root: Path, top: str = TOP) -> list[tuple[str, str, str]]:
    """(from, to, where) of every import between two top-level packages of ``top``."""
    _, found = _graph(root, top)
    edges: list[tuple[str, str, str]] = []
    for i in found:
        a, b = top_level(i.source, top), top_level(i.target, top)
        if a != b and top not in (a, b):
            edges.append((a, b, i.where))
    return edges


def top_level_cycles(
    root: Path, top: str = TOP, known: Mapping[tuple[str, str], Known] = KNOWN
) -> list[Cycle]:
    """Cycles between top-level packages, the imports of ``known`` left out."""
    return cycles(e for e in top_level_imports(root, top) if not _allowed(e[:2], e[2], known))


def layer_breaches(
    root: Path,
    top: str = TOP,
    layers: tuple[frozenset[str], ...] = LAYERS,
    known: Mapping[tuple[str, str], Known] = KNOWN,
) -> list[str]:
    """One line per import from a lower layer up to a higher one (``known`` left out), and
    one per top-level package that has no layer."""
    layer_of = {f"{top}.{name}": n for n, layer in enumerate(layers) for name in layer}
    problems: list[str] = []
    edges = top_level_imports(root, top)
    for package in sorted({p for a, b, _ in edges for p in (a, b)} - set(layer_of)):
        problems.append(f"{package} is in no layer: place it in LAYERS")
    for a, b, where in edges:
        upward = a in layer_of and b in layer_of and layer_of[a] < layer_of[b]
        if upward and not _allowed((a, b), where, known):
            problems.append(f"{a} (layer {layer_of[a]}) -> {b} (layer {layer_of[b]})  ({where})")
    return list(dict.fromkeys(problems))  # one line per statement, not per name


def stale_known(
    root: Path, top: str = TOP, known: Mapping[tuple[str, str], Known] = KNOWN
) -> list[str]:
    """The entries of ``known`` that no import uses any more: to be removed."""
    used = {e[:2] for e in top_level_imports(root, top) if _allowed(e[:2], e[2], known)}
    return [
        f"{a} -> {b} ({', '.join(k.files)})" for (a, b), k in known.items() if (a, b) not in used
    ]


def test_no_cycle_between_top_level_packages() -> None:
    found = top_level_cycles(ROOT)
    if found:
        pytest.fail(
            "import cycles between top-level packages of services/:\n" + describe(found),
            pytrace=False,
        )


def test_top_level_packages_import_down_the_layers() -> None:
    problems = layer_breaches(ROOT)
    if problems:
        pytest.fail(
            "imports up the layers (LAYERS, bottom to top):\n" + "\n".join(problems),
            pytrace=False,
        )


def test_the_known_imports_all_still_exist() -> None:
    stale = stale_known(ROOT)
    if stale:
        pytest.fail("KNOWN entries no import needs any more:\n" + "\n".join(stale), pytrace=False)


def test_a_cycle_through_subpackages_is_a_top_level_cycle(tmp_path: Path) -> None:
    _write(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/a/__init__.py": "",
            "pkg/a/deep/__init__.py": "",
            "pkg/a/deep/m.py": "def f() -> None:\n    import pkg.b.n\n",
            "pkg/b/__init__.py": "",
            "pkg/b/n.py": "from pkg.a import other\n",
            "pkg/a/other.py": "",
        },
    )
    assert package_cycles(tmp_path, "pkg") == []  # pkg.a.deep, pkg.b and pkg.a: no cycle
    assert describe(top_level_cycles(tmp_path, "pkg", {})) == (
        "pkg.a -> pkg.b -> pkg.a\n"
        "    pkg.a -> pkg.b  (pkg/a/deep/m.py:2)\n"
        "    pkg.b -> pkg.a  (pkg/b/n.py:1)"
    )
    known = {("pkg.a", "pkg.b"): Known(("pkg/a/deep/",), "test")}
    assert top_level_cycles(tmp_path, "pkg", known) == []
    assert stale_known(tmp_path, "pkg", known) == []
    elsewhere = {("pkg.a", "pkg.b"): Known(("pkg/a/other.py",), "test")}
    assert len(top_level_cycles(tmp_path, "pkg", elsewhere)) == 1
    assert stale_known(tmp_path, "pkg", elsewhere) == ["pkg.a -> pkg.b (pkg/a/other.py)"]


def test_an_import_up_the_layers_is_a_breach(tmp_path: Path) -> None:
    _write(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/low/__init__.py": "",
            "pkg/low/x.py": (
                "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.high\n"
            ),
            "pkg/high/__init__.py": "from pkg.low import x\n",
            "pkg/stray/__init__.py": "import pkg.low\n",
        },
    )
    layers = (frozenset({"low"}), frozenset({"high"}))
    assert layer_breaches(tmp_path, "pkg", layers, {}) == [
        "pkg.stray is in no layer: place it in LAYERS",
        "pkg.low (layer 0) -> pkg.high (layer 1)  (pkg/low/x.py:3)",
    ]
    known = {("pkg.low", "pkg.high"): Known(("pkg/low/x.py",), "test")}
    assert layer_breaches(tmp_path, "pkg", (*layers, frozenset({"stray"})), known) == []
