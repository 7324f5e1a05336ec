"""The project's import graph, built statically: kernels/ imports nothing of detkit mode or the harness (toolkit/,
audits/, bench/, tools/), mode/ nothing of the harness, bench/ nothing of audits/ (what both need lives in toolkit/
or kernels/); each kernel family imports only the plumbing the families share (kernels/backend.py, kernels/bounds.py,
kernels/interpreter.py) and det_gemm's tile math; no module imports a bare top-level
``kernels``/``mode``/``toolkit``/``audits``/``bench`` name (installed, they exist only as ``detkit.<part>``), and no
import cycle exists anywhere. Imports inside functions count: a cycle hidden by a lazy import is still a cycle of
concepts, and a lazy import still runs.

The graph is read with ``ast`` (no module is imported): every ``import`` / ``from ... import`` statement in every
.py file of kernels/, toolkit/, audits/, bench/, detkit/ and tools/ (when present), plus
``importlib.import_module("<literal>")`` calls. An edge goes to each project module a statement names: ``from
detkit.kernels import moe`` names detkit.kernels.moe, ``from detkit.kernels.moe.layer import moe_mlp`` names
detkit.kernels.moe.layer."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Repository folder -> import name of the package it holds (pyproject.toml's package-dir). tools/ is not part of the
# installed distribution: its scripts import detkit.* and nothing imports them.
PARTS = {"kernels": "detkit.kernels", "mode": "detkit.mode", "toolkit": "detkit.toolkit", "audits": "detkit.audits",
         "bench": "detkit.bench", "detkit": "detkit", "tools": "tools"}
BARE_NAMES = ("kernels", "mode", "toolkit", "audits", "bench")
KERNELS = "detkit.kernels"
MODE = "detkit.mode"
HARNESS = ("detkit.toolkit", "detkit.audits", "detkit.bench", "tools")
BENCH, AUDITS = "detkit.bench", "detkit.audits"
# What each layer must never import: a kernel neither the mode built on it nor the harness; the mode not the harness;
# a benchmark (it times) not an audit (it checks).
FORBIDDEN = {KERNELS: (MODE, *HARNESS), MODE: HARNESS, BENCH: (AUDITS,)}
# Inside kernels/: the plumbing every family shares, and what each family may import besides its own modules and the
# plumbing (det_gemm's tile math and launch helpers are the building blocks of the other families' GEMMs).
PLUMBING = ("detkit.kernels.backend", "detkit.kernels.bounds", "detkit.kernels.interpreter")
FAMILY_MAY_IMPORT = {"det_gemm": (), "attention": ("det_gemm",), "moe": ("det_gemm",), "parallel": ("det_gemm",),
                     "reductions": ("det_gemm",), "grouped": ("det_gemm",), "rotary": ("det_gemm",)}


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def module_files(root: Path) -> dict[str, Path]:
    """Import name -> file, for every .py file of the project's parts under ``root``."""
    found = {}
    for folder, package in PARTS.items():
        base = root / folder
        if not base.is_dir():
            continue
        for path in sorted(base.rglob("*.py")):
            parts = list(path.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([package, *parts])] = path
    return found


def _imported_names(tree: ast.AST, module: str, is_package: bool) -> list[tuple[tuple[str, ...], int]]:
    """Every import of the tree, anywhere in it (function bodies included), as (candidate dotted names, line):
    the first candidate that is a project module is the one imported. ``import a.b`` gives (a.b,); ``from a.b import
    c`` gives (a.b.c, a.b) for each name c (c may be a module); relative imports are resolved against ``module``;
    an ``importlib.import_module("literal")`` call gives (literal,)."""
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [((alias.name,), node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".") if is_package else module.split(".")[:-1]
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            names += [((f"{base}.{alias.name}", base), node.lineno) for alias in node.names]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            names.append(((node.args[0].value,), node.lineno))
    return names


def build_graph(root: Path = ROOT) -> tuple[dict[str, set[str]], list[str]]:
    """(module -> the project modules it imports, the bare top-level imports found as "file:line: name")."""
    files = module_files(root)
    graph: dict[str, set[str]] = {m: set() for m in files}
    bare = []
    for module, path in files.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for candidates, line in _imported_names(tree, module, path.name == "__init__.py"):
            if candidates[-1].split(".")[0] in BARE_NAMES:
                bare.append(f"{path.relative_to(root)}:{line}: {candidates[-1]}")
            target = next((name for name in candidates if name in files), None)
            if target is not None and target != module:
                graph[module].add(target)
    return graph, bare


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    """Edges a layer must not have (``FORBIDDEN``): kernels into the mode or the harness, the mode into the harness."""
    return sorted(f"{src} -> {dst}" for src, dsts in graph.items() for layer, banned in FORBIDDEN.items()
                  if _within(src, layer) for dst in dsts if any(_within(dst, b) for b in banned))


def family_of(module: str) -> str | None:
    """The kernel family a detkit.kernels module belongs to (its sub-package), "plumbing" for the shared modules,
    None outside kernels/ (and for the kernels package itself)."""
    if module in PLUMBING:
        return "plumbing"
    if not _within(module, KERNELS) or module == KERNELS:
        return None
    return module.split(".")[2]


def family_violations(graph: dict[str, set[str]]) -> list[str]:
    """Edges between kernel families that ``FAMILY_MAY_IMPORT`` does not allow (the plumbing may import no family;
    a module directly in kernels/ that is neither plumbing nor a family is reported as its own family)."""
    found = []
    for src, dsts in graph.items():
        src_family = family_of(src)
        if src_family is None:
            continue
        allowed = {src_family, "plumbing", *FAMILY_MAY_IMPORT.get(src_family, ())}
        if src_family == "plumbing":
            allowed = {"plumbing"}
        found += [f"{src} -> {dst}" for dst in dsts
                  if family_of(dst) is not None and family_of(dst) not in allowed]
    return sorted(found)


def cycles(graph: dict[str, set[str]]) -> list[tuple[list[str], list[str]]]:
    """Per strongly connected component of more than one module (Tarjan's algorithm, iterative): one cycle through
    it (its modules in import order, the first repeated at the end) and all of its modules."""
    index, low, on_stack, stack, comps = {}, {}, set(), [], []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
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
                comp = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    comp.append(member)
                    if member == node:
                        break
                if len(comp) > 1:
                    comps.append(set(comp))
    return [(_cycle_in(graph, comp), sorted(comp)) for comp in sorted(comps, key=min)]


def _cycle_in(graph: dict[str, set[str]], comp: set[str]) -> list[str]:
    """A shortest cycle through the component's first module (breadth-first within the component)."""
    start = min(comp)
    parent = {start: None}
    frontier = [start]
    while frontier:
        nxt = []
        for node in frontier:
            for child in sorted(graph.get(node, ())):
                if child == start:
                    path = [node]
                    while parent[path[-1]] is not None:
                        path.append(parent[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if child in comp and child not in parent:
                    parent[child] = node
                    nxt.append(child)
        frontier = nxt
    raise AssertionError(f"no cycle through {start} in {sorted(comp)}")


def problems(graph: dict[str, set[str]], bare: list[str]) -> list[str]:
    """Every rule the graph breaks, one line each."""
    return ([f"layer imports what it must not: {edge}" for edge in layer_violations(graph)]
            + [f"kernel family imports another family: {edge}" for edge in family_violations(graph)]
            + [f"bare top-level import: {b}" for b in bare]
            + [f"import cycle: {' -> '.join(path)}" + (f" (modules of the cycle: {', '.join(comp)})"
                                                        if len(comp) + 1 > len(path) else "")
               for path, comp in cycles(graph)])


# --------------------------------------------------------------------------------------------- the project
@pytest.fixture(scope="module")
def project():
    return build_graph()


def test_the_graph_covers_the_project(project):
    graph, _ = project
    # The parts and their best-known modules are found, with edges where the code has imports (a reader that
    # found nothing would pass every rule below).
    for module in ("detkit", "detkit.kernels.det_gemm.launch", "detkit.kernels.moe.layer", "detkit.toolkit.cli",
                   "detkit.audits.moe", "detkit.bench.moe"):
        assert module in graph, module
    assert "detkit.kernels.det_gemm.launch" in graph["detkit.kernels.moe.fp8.layer"] | set().union(
        *(graph[m] for m in graph["detkit.kernels.moe.fp8.layer"]))
    assert sum(len(d) for d in graph.values()) > 100


def test_layers_import_only_downwards(project):
    graph, _ = project
    found = [p for p in problems(graph, []) if p.startswith("layer imports")]
    assert not found, "\n".join(found)


def test_kernel_families_stay_in_their_rooms(project):
    graph, _ = project
    found = [p for p in problems(graph, []) if p.startswith("kernel family")]
    assert not found, "\n".join(found)
    # Every module file directly in kernels/ is plumbing (a new one is a family waiting for its folder), and every
    # folder there is a family the rule above knows.
    files = {f"{KERNELS}.{p.stem}" for p in (ROOT / "kernels").glob("*.py") if p.stem != "__init__"}
    assert files == set(PLUMBING), sorted(files)
    folders = {p.name for p in (ROOT / "kernels").iterdir() if (p / "__init__.py").is_file()}
    assert folders == set(FAMILY_MAY_IMPORT), sorted(folders)


def test_no_bare_top_level_part_names(project):
    _, bare = project
    assert not bare, "\n".join(bare)


def test_no_import_cycles(project):
    graph, _ = project
    found = [p for p in problems(graph, []) if p.startswith("import cycle")]
    assert not found, "\n".join(found)


# --------------------------------------------------------------------------------------------- the checker itself
def test_the_checker_reports_a_cycle_and_a_kernel_to_harness_edge():
    graph = {
        "detkit.kernels.x.a": {"detkit.kernels.x.b", "detkit.toolkit.harness"},
        "detkit.kernels.x.b": {"detkit.kernels.x.c"},
        "detkit.kernels.x.c": {"detkit.kernels.x.a"},
        "detkit.toolkit.harness": {"detkit.kernels.x.b"},
        "detkit.audits.x": {"detkit.kernels.x.a"},  # harness -> kernels is the allowed direction
    }
    found = problems(graph, [])
    assert "layer imports what it must not: detkit.kernels.x.a -> detkit.toolkit.harness" in found
    # a, b, c and the harness (which imports b) form one strongly connected component; its shortest cycle through
    # its first module:
    assert ("import cycle: detkit.kernels.x.a -> detkit.kernels.x.b -> detkit.kernels.x.c -> detkit.kernels.x.a "
            "(modules of the cycle: detkit.kernels.x.a, detkit.kernels.x.b, detkit.kernels.x.c, "
            "detkit.toolkit.harness)") in found
    assert len(found) == 2, found
    assert problems({"detkit.kernels.x.a": {"detkit.kernels.x.b"}, "detkit.kernels.x.b": set()}, []) == []


def test_the_checker_reports_mode_and_family_edges():
    graph = {
        "detkit.kernels.moe.layer": {"detkit.mode.switch", "detkit.kernels.attention",
                                     "detkit.kernels.det_gemm.launch", "detkit.kernels.backend"},
        "detkit.kernels.backend": {"detkit.kernels.det_gemm.launch"},
        "detkit.kernels.det_gemm.launch": {"detkit.kernels.backend"},
        "detkit.kernels.attention": {"detkit.kernels.det_gemm.kernels"},
        "detkit.kernels.det_gemm.kernels": set(),
        "detkit.mode.switch": {"detkit.kernels.moe.layer", "detkit.toolkit.timing"},
        "detkit.toolkit.timing": set(),
        "detkit.bench.y": {"detkit.audits.x", "detkit.toolkit.timing"},
        "detkit.audits.x": {"detkit.toolkit.timing"},
    }
    found = [p for p in problems(graph, []) if not p.startswith("import cycle")]
    assert found == [
        "layer imports what it must not: detkit.bench.y -> detkit.audits.x",
        "layer imports what it must not: detkit.kernels.moe.layer -> detkit.mode.switch",
        "layer imports what it must not: detkit.mode.switch -> detkit.toolkit.timing",
        "kernel family imports another family: detkit.kernels.backend -> detkit.kernels.det_gemm.launch",
        "kernel family imports another family: detkit.kernels.moe.layer -> detkit.kernels.attention",
    ], found


def test_the_reader_sees_lazy_relative_and_bare_imports(tmp_path):
    (tmp_path / "kernels" / "x").mkdir(parents=True)
    (tmp_path / "toolkit").mkdir()
    (tmp_path / "kernels" / "__init__.py").write_text("")
    (tmp_path / "kernels" / "x" / "__init__.py").write_text("")
    (tmp_path / "toolkit" / "__init__.py").write_text("")
    (tmp_path / "kernels" / "x" / "a.py").write_text(
        "import torch\n"
        "def f():\n"
        "    from detkit.toolkit import harness  # lazy\n"
        "    return harness\n")
    (tmp_path / "kernels" / "x" / "b.py").write_text("from . import a\nfrom .a import f\n")
    (tmp_path / "toolkit" / "harness.py").write_text(
        "import importlib\n"
        "import kernels.x.b\n"
        "def g():\n"
        "    return importlib.import_module('detkit.kernels.x.b')\n")
    graph, bare = build_graph(tmp_path)
    assert graph["detkit.kernels.x.a"] == {"detkit.toolkit.harness"}
    assert graph["detkit.kernels.x.b"] == {"detkit.kernels.x.a"}
    assert graph["detkit.toolkit.harness"] == {"detkit.kernels.x.b"}
    assert bare == ["toolkit/harness.py:2: kernels.x.b"]
    assert problems(graph, bare) == [
        "layer imports what it must not: detkit.kernels.x.a -> detkit.toolkit.harness",
        "bare top-level import: toolkit/harness.py:2: kernels.x.b",
        "import cycle: detkit.kernels.x.a -> detkit.toolkit.harness -> detkit.kernels.x.b -> detkit.kernels.x.a",
    ]
