"""No import circle among the modules of hvd_commopt/, torch_plugin/ and tf_plugin/.

Every ``import``/``from ... import`` is read with ``ast``, those inside functions included (a late
import hides a circle, it does not remove it); relative imports are resolved against the module's
package. ``from pkg import name`` is an edge to ``pkg.name`` when that is a module, else to
``pkg`` (its ``__init__``), unless ``name`` is a compiled extension. Parent packages that Python initialises on the way are not edges:
only what a module names."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("hvd_commopt", "torch_plugin", "tf_plugin")

def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def _extension(package_init: Path, name: str) -> bool:
    """``name`` is a compiled module of the package (``from . import _hostkernels``: its C sources
    or the built library sit beside ``__init__.py``), not a name the package defines."""
    return package_init.name == "__init__.py" and any(
        p.suffix != ".py" for p in package_init.parent.glob(f"{name}.*"))


def _edges(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    is_pkg = path.name == "__init__.py"
    package = name.split(".") if is_pkg else name.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in modules)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for a in node.names:
                sub = f"{target}.{a.name}"
                if sub in modules:
                    found.add(sub)
                elif target in modules and not _extension(modules[target], a.name):
                    found.add(target)
    found.discard(name)
    return found


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _edges(name, path, modules) for name, path in modules.items()}


def test_the_scan_sees_function_level_and_relative_imports():
    graph = _graph()
    assert "hvd_commopt.engine.ports" in graph["hvd_commopt.engine.engine"]  # from .ports import ...
    assert "hvd_commopt.comm.inproc" in graph["hvd_commopt.process_sets"]  # inside a method
    assert "torch_plugin.plain" in graph["torch_plugin.autograd"]  # from . import plain as P


def test_no_import_circle():
    assert _circles(_graph()) == []
