"""The core's layers import downwards only: no cycle between the engine and the schedulers, no
compressor that knows the engine, pure planners, a selection package below the compressors that
knows no framework. Checked on the source (every import statement, late ones inside functions
included)."""
from __future__ import annotations

import ast
from pathlib import Path

CORE = Path(__file__).resolve().parents[2] / "hvd_commopt"

# package -> packages (of hvd_commopt) it must never import
FORBIDDEN = {
    "engine": {"schedule", "builder", "collectives", "runtime"},
    "compress": {"engine", "reduce", "schedule", "comm", "fusion", "builder"},
    "reduce": {"engine", "schedule", "builder", "runtime"},
    "fusion": {"engine", "reduce", "compress", "schedule", "comm", "builder", "calibrate"},
    "comm": {"engine", "reduce", "compress", "schedule", "fusion", "numpy_ops", "builder"},
    "schedule": {"builder", "runtime", "collectives"},
    # the selection algorithms and their kernels: below the compressors (whose selectors use them),
    # the memories, the reducers and the engine
    "select": {"engine", "reduce", "schedule", "compress", "comm", "fusion", "builder", "runtime", "collectives",
               "numpy_ops", "calibrate", "process_sets", "compression"},
    "memory": {"reduce", "engine", "schedule", "builder", "collectives", "runtime", "comm", "fusion"},
    # compression="auto": a reducer and its policy, below the engine that drives them
    "autocompress": {"engine", "schedule", "builder", "collectives", "runtime", "compression"},
}

# package -> modules (of hvd_commopt, dotted) it must never import: a memory knows no selector
# (compress's selectors and selection strategies) and no adapter
FORBIDDEN_MODULES = {
    "memory": {"compress.selector", "compress.topk", "compress.dgc", "compress.randomk",
               "compress.sampling", "select.strategies", "torch_plugin", "tf_plugin", "torch", "tensorflow"},
}
ADAPTERS = ("torch", "tensorflow", "torch_plugin", "tf_plugin")


def _imports(path: Path) -> set[str]:
    """The first component under hvd_commopt of every module ``path`` imports."""
    pkg = path.relative_to(CORE).parts[:-1]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the file's package
                base = list(pkg[: len(pkg) - node.level + 1])
                parts = base + (node.module.split(".") if node.module else [])
                if not parts:  # "from .. import x" at the top of the package
                    parts = [a.name for a in node.names]
            elif node.module and node.module.startswith("hvd_commopt."):
                parts = node.module.split(".")[1:]
            else:
                continue
            out.add(parts[0])
        elif isinstance(node, ast.Import):
            out |= {a.name.split(".")[1] for a in node.names if a.name.startswith("hvd_commopt.")}
    return out


def _modules(path: Path) -> set[str]:
    """Every module ``path`` imports, dotted: under hvd_commopt without the prefix (``compress.topk``;
    ``from ..compress import topk`` counts as ``compress`` and ``compress.topk``), others as written."""
    pkg = path.relative_to(CORE).parts[:-1]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                parts = list(pkg[: len(pkg) - node.level + 1]) + (node.module.split(".") if node.module else [])
            elif node.module and node.module.startswith("hvd_commopt."):
                parts = node.module.split(".")[1:]
            else:
                out.add(node.module or "")
                continue
            base = ".".join(parts)
            out |= {base} | {f"{base}.{a.name}" if base else a.name for a in node.names}
        elif isinstance(node, ast.Import):
            for a in node.names:
                out.add(a.name[len("hvd_commopt."):] if a.name.startswith("hvd_commopt.") else a.name)
    return out


def test_memory_imports_no_selector_and_no_adapter() -> None:
    bad = []
    for layer, banned in FORBIDDEN_MODULES.items():
        for f in (CORE / layer).rglob("*.py"):
            hit = {m for m in _modules(f) if any(m == b or m.startswith(b + ".") for b in banned)}
            if hit:
                bad.append(f"{f.relative_to(CORE)} imports {sorted(hit)}")
    assert not bad, bad


def test_layers_import_downwards_only() -> None:
    bad = []
    for layer, banned in FORBIDDEN.items():
        for f in (CORE / layer).rglob("*.py"):
            hit = _imports(f) & banned
            if hit:
                bad.append(f"{f.relative_to(CORE)} imports {sorted(hit)}")
    assert not bad, bad


def _top_level_imports(path: Path) -> set[str]:
    """The first component of every absolute import in ``path``."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and not node.level and node.module:
            out.add(node.module.split(".")[0])
        elif isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
    return out


def test_the_selection_package_knows_no_framework_and_no_adapter() -> None:
    bad = [f"{f.relative_to(CORE)} imports {sorted(_top_level_imports(f) & set(ADAPTERS))}"
           for f in (CORE / "select").rglob("*.py") if _top_level_imports(f) & set(ADAPTERS)]
    assert not bad, bad


def test_the_adapters_ops_hold_no_selection_routes() -> None:
    """The adapters' TensorOps import nothing from the selection package: its kernels run on their
    host views (hvd_commopt/select/host.py) or their primitives (select/portable.py)."""
    root = CORE.parent
    for f in (root / "torch_plugin" / "ops.py", root / "torch_plugin" / "device_route_ops.py",
              root / "tf_plugin" / "ops.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                assert not node.module.startswith("hvd_commopt.select"), f"{f.name}: {node.module}"
            elif isinstance(node, ast.Import):
                assert not any(a.name.startswith("hvd_commopt.select") for a in node.names), f.name


def _module_imports(path: Path) -> set[str]:
    """The hvd_commopt modules (dotted, under hvd_commopt) ``path`` imports, late imports included."""
    pkg = list(path.relative_to(CORE).parts[:-1])
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg[: len(pkg) - node.level + 1]
                mod = base + (node.module.split(".") if node.module else [])
            elif node.module and node.module.startswith("hvd_commopt."):
                mod = node.module.split(".")[1:]
            else:
                continue
            names = [mod + [a.name] for a in node.names] if node.names else []
            out |= {".".join(n) for n in names if (CORE.joinpath(*n).with_suffix(".py")).exists()}
            out.add(".".join(mod))
        elif isinstance(node, ast.Import):
            out |= {a.name.split(".", 1)[1] for a in node.names if a.name.startswith("hvd_commopt.")}
    return out


def test_the_selection_package_has_no_import_circle() -> None:
    """select/ and the host-memory kernels import each other's modules without a circle."""
    files = list((CORE / "select").rglob("*.py")) + [CORE / "host_memory.py"]
    name = {f: ".".join(f.relative_to(CORE).with_suffix("").parts) for f in files}
    graph = {name[f]: {m for m in _module_imports(f) if m in name.values()} for f in files}
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for n in graph.get(m, ()):
            assert state.get(n) != 1, " -> ".join(path + [m, n])
            if n not in state:
                visit(n, path + [m])
        state[m] = 2

    for m in graph:
        if m not in state:
            visit(m, [])


def test_the_stream_seam_sits_below_the_engine_and_knows_no_framework() -> None:
    # docs/backends.md#cuda-streams: the engine and the adapters import it, it imports neither
    f = CORE / "streams.py"
    assert _imports(f) <= {"buckets"}, _imports(f)
    assert not _top_level_imports(f) & set(ADAPTERS), _top_level_imports(f)
