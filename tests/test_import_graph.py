"""The project's import graph, built statically: kernels/ imports nothing of the harness (toolkit/, audits/, bench/,
tools/), bench/ imports nothing of audits/ (what both need lives in toolkit/ or kernels/), no module imports a bare
top-level ``kernels``/``toolkit``/``audits``/``bench`` name (installed, they exist only as ``detkit.<part>``), and no
import cycle exists anywhere. Imports inside functions count: a cycle hidden by a lazy import is still a cycle of
concepts, and a lazy import still runs.

The graph is read with ``ast`` (no module is imported): every ``import`` / ``from ... import`` statement in every
.py file of kernels/, toolkit/, audits/, bench/, detkit/ and tools/ (when present), plus
``importlib.import_module("<literal>")`` calls. An edge goes to each project module a statement names: ``from
detkit.kernels import moe`` names detkit.kernels.moe, ``from detkit.kernels.moe import moe_mlp`` names
detkit.kernels.moe."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Repository folder -> import name of the package it holds (pyproject.toml's package-dir). tools/ is not part of the
# installed distribution: its scripts import detkit.* and nothing imports them.
PARTS = {"kernels": "detkit.kernels", "toolkit": "detkit.toolkit", "audits": "detkit.audits",
         "bench": "detkit.bench", "detkit": "detkit", "tools": "tools"}
BARE_NAMES = ("kernels", "toolkit", "audits", "bench")
KERNELS = "detkit.kernels"
HARNESS = ("detkit.toolkit", "detkit.audits", "detkit.bench", "tools")
BENCH, AUDITS = "detkit.bench", "detkit.audits"


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
    """Edges from kernels/ into the harness (toolkit, audits, bench, tools)."""
    return sorted(f"{src} -> {dst}" for src, dsts in graph.items() if _within(src, KERNELS)
                  for dst in dsts if any(_within(dst, h) for h in HARNESS))


def bench_violations(graph: dict[str, set[str]]) -> list[str]:
    """Edges from bench/ into audits/: a benchmark times, an audit checks; what both need (fixtures, comparators, the
    model they build) lives in toolkit/ or with the kernels."""
    return sorted(f"{src} -> {dst}" for src, dsts in graph.items() if _within(src, BENCH)
                  for dst in dsts if _within(dst, AUDITS))


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
    return ([f"kernel imports the harness: {edge}" for edge in layer_violations(graph)]
            + [f"bench imports an audit: {edge}" for edge in bench_violations(graph)]
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
    for module in ("detkit", "detkit.kernels.det_gemm", "detkit.kernels.moe", "detkit.toolkit.cli",
                   "detkit.audits.moe", "detkit.bench.moe"):
        assert module in graph, module
    assert "detkit.kernels.det_gemm" in graph["detkit.kernels.moe_fp8"] | set().union(
        *(graph[m] for m in graph["detkit.kernels.moe_fp8"]))
    assert sum(len(d) for d in graph.values()) > 100


def test_kernels_never_import_the_harness(project):
    graph, _ = project
    found = [p for p in problems(graph, []) if p.startswith("kernel imports")]
    assert not found, "\n".join(found)


def test_benches_never_import_the_audits(project):
    graph, _ = project
    found = [p for p in problems(graph, []) if p.startswith("bench imports")]
    assert not found, "\n".join(found)


def test_no_bare_top_level_part_names(project):
    _, bare = project
    assert not bare, "\n".join(bare)


def test_no_import_cycles(project):
    graph, _ = project
    found = [p for p in problems(graph, []) if p.startswith("import cycle")]
    assert not found, "\n".join(found)


# --------------------------------------------------------------------------------------------- the checker itself
def test_the_checker_reports_a_cycle_a_kernel_to_harness_edge_and_a_bench_to_audit_edge():
    graph = {
        "detkit.kernels.a": {"detkit.kernels.b", "detkit.toolkit.harness"},
        "detkit.kernels.b": {"detkit.kernels.c"},
        "detkit.kernels.c": {"detkit.kernels.a"},
        "detkit.toolkit.harness": {"detkit.kernels.b"},
        "detkit.audits.x": {"detkit.kernels.a", "detkit.toolkit.harness"},  # harness -> kernels is allowed
        "detkit.bench.y": {"detkit.audits.x", "detkit.toolkit.harness", "detkit.kernels.a"},
    }
    found = problems(graph, [])
    assert "kernel imports the harness: detkit.kernels.a -> detkit.toolkit.harness" in found
    assert "bench imports an audit: detkit.bench.y -> detkit.audits.x" in found
    # a, b, c and the harness (which imports b) form one strongly connected component; its shortest cycle through
    # its first module:
    assert ("import cycle: detkit.kernels.a -> detkit.kernels.b -> detkit.kernels.c -> detkit.kernels.a (modules of "
            "the cycle: detkit.kernels.a, detkit.kernels.b, detkit.kernels.c, detkit.toolkit.harness)") in found
    assert len(found) == 3, found
    assert problems({"detkit.kernels.a": {"detkit.kernels.b"}, "detkit.kernels.b": set()}, []) == []


def test_the_reader_sees_lazy_relative_and_bare_imports(tmp_path):
    (tmp_path / "kernels").mkdir()
    (tmp_path / "toolkit").mkdir()
    (tmp_path / "kernels" / "__init__.py").write_text("")
    (tmp_path / "toolkit" / "__init__.py").write_text("")
    (tmp_path / "kernels" / "a.py").write_text(
        "import torch\n"
        "def f():\n"
        "    from detkit.toolkit import harness  # lazy\n"
        "    return harness\n")
    (tmp_path / "kernels" / "b.py").write_text("from . import a\nfrom .a import f\n")
    (tmp_path / "toolkit" / "harness.py").write_text(
        "import importlib\n"
        "import kernels.b\n"
        "def g():\n"
        "    return importlib.import_module('detkit.kernels.b')\n")
    graph, bare = build_graph(tmp_path)
    assert graph["detkit.kernels.a"] == {"detkit.toolkit.harness"}
    assert graph["detkit.kernels.b"] == {"detkit.kernels.a"}
    assert graph["detkit.toolkit.harness"] == {"detkit.kernels.b"}
    assert bare == ["toolkit/harness.py:2: kernels.b"]
    assert problems(graph, bare) == [
        "kernel imports the harness: detkit.kernels.a -> detkit.toolkit.harness",
        "bare top-level import: toolkit/harness.py:2: kernels.b",
        "import cycle: detkit.kernels.a -> detkit.toolkit.harness -> detkit.kernels.b -> detkit.kernels.a",
    ]
