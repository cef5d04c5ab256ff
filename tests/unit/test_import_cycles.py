"""No import cycles inside the project's packages.

A cycle works only while every module in it is imported in a lucky order (or defers an import
into a function or behind TYPE_CHECKING), and it hides which module is the lower layer. The
graph is read from the sources with `ast`, so nothing is imported (no torch), and every import
counts: deferred ones and TYPE_CHECKING ones too, since they only move the cycle out of sight.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCE_ROOTS = {
    "pdd_api": ROOT / "operator",
    "pdd_cli": ROOT / "operator",
    "pdd_operator": ROOT / "operator",
    "pdd_sidecar": ROOT / "sidecar",
}


def _modules(root: Path, package: str) -> dict[str, Path]:
    """Dotted module name -> file, for one package under a source root."""
    out = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imported(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> list[str]:
    """The names an import statement brings in, made absolute; `from a import b` names both
    `a.b` (when b is a module) and `a` (when b is an attribute of it)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        anchor = module.split(".") if is_package else module.split(".")[:-1]
        anchor = anchor[: len(anchor) - (node.level - 1)]
        base = ".".join([*anchor, base] if base else anchor)
    return [base, *(f"{base}.{alias.name}" for alias in node.names)]


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the modules of the same set it imports anywhere in its source."""
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for target in _imported(node, name, is_package):
                if isinstance(node, ast.ImportFrom) and target not in modules:
                    continue  # an attribute, not a module
                # `import a.b.c` runs a, a.b and a.b.c; the longest known prefix is the edge.
                parts = target.split(".")
                while parts and ".".join(parts) not in modules:
                    parts.pop()
                if parts and ".".join(parts) != name:
                    graph[name].add(".".join(parts))
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def _project_modules() -> dict[str, Path]:
    modules: dict[str, Path] = {}
    for package, root in SOURCE_ROOTS.items():
        modules.update(_modules(root, package))
    return modules


def test_the_project_has_no_import_cycles() -> None:
    modules = _project_modules()
    assert len(modules) > 50, "the source roots moved; the walk found too little"
    found = cycles(import_graph(modules))
    assert not found, f"import cycles (each a set of modules that import one another): {found}"


def test_the_walk_sees_the_edges_that_matter() -> None:
    graph = import_graph(_project_modules())
    assert "pdd_api.models" in graph["pdd_api.validation"]
    assert "pdd_sidecar.serve.router.upstreams" in graph["pdd_sidecar.serve.router.router"]


def _tree(tmp_path: Path, files: dict[str, str]) -> dict[str, Path]:
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return _modules(tmp_path, "pkg")


@pytest.mark.parametrize("files", [
    pytest.param({  # a deferred import closing the circle
        "pkg/__init__.py": "",
        "pkg/crd.py": "from pkg.validation import NAME\n",
        "pkg/validation.py": "from pkg.structural import normalize\nNAME = 1\n",
        "pkg/structural.py": "def schema():\n    from pkg.crd import spec_schema\n",
    }, id="deferred"),
    pytest.param({  # one side only under TYPE_CHECKING
        "pkg/__init__.py": "",
        "pkg/engine/__init__.py": "",
        "pkg/engine/cuda_graphs.py": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                      "    from pkg.engine.rank_engine import SeqChunk\n"),
        "pkg/engine/rank_engine.py": "from pkg.engine.cuda_graphs import capture\n",
    }, id="type-checking"),
    pytest.param({  # relative imports and `from package import module`
        "pkg/__init__.py": "",
        "pkg/a.py": "from . import b\n",
        "pkg/b.py": "from .sub import c\n",
        "pkg/sub/__init__.py": "",
        "pkg/sub/c.py": "import pkg.a\n",
    }, id="relative"),
])
def test_a_cycle_is_found(tmp_path: Path, files: dict[str, str]) -> None:
    found = cycles(import_graph(_tree(tmp_path, files)))
    assert len(found) == 1 and len(found[0]) >= 2


def test_a_layered_tree_has_no_cycle(tmp_path: Path) -> None:
    modules = _tree(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/names.py": "NAME = 1\n",
        "pkg/crd.py": "from pkg.names import NAME\n",
        "pkg/validation.py": "from pkg import names\nfrom pkg.structural import normalize\n",
        "pkg/structural.py": "def schema():\n    from pkg.crd import spec_schema\n",
    })
    graph = import_graph(modules)
    assert graph["pkg.validation"] == {"pkg.names", "pkg.structural", "pkg"}
    assert cycles(graph) == []
