"""The repository is self-contained: every docs/ citation in the code resolves to an anchor, and
no comment cites a document or issue tracker that is not in the repository."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCES = [p for d in ("hvd_commopt", "torch_plugin", "tf_plugin", "tests", "benchmarks", "examples")
           for p in (ROOT / d).rglob("*.py")] + list((ROOT / "benchmarks").rglob("*.md")) + [ROOT / "README.md"]


def _anchors() -> dict[str, set[str]]:
    out = {}
    for md in (ROOT / "docs").glob("*.md"):
        text = md.read_text()
        out[f"docs/{md.name}"] = set(re.findall(r'<a id="([^"]+)"', text))
    return out


def test_every_docs_citation_resolves() -> None:
    anchors = _anchors()
    missing = [(str(p.relative_to(ROOT)), f, a) for p in SOURCES
               for f, a in re.findall(r"(docs/[a-z0-9-]+\.md)#([a-z0-9-]+)", p.read_text())
               if a not in anchors.get(f, set())]
    assert not missing, missing
    for md in (ROOT / "docs").glob("*.md"):  # links between the docs themselves
        for f, a in re.findall(r"\(([a-z0-9-]+\.md)#([a-z0-9-]+)\)", md.read_text()):
            assert a in anchors.get(f"docs/{f}", set()), (md.name, f, a)


def test_no_citation_of_documents_outside_the_repository() -> None:
    # "spec T-OD-1": the invariant ids are defined in docs/ (docs/README.md#invariant-ids); cite the anchor
    outside = re.compile(r"spec §|§\d|\bspec T-|\[(?:INF|CODE|NOT-READ)\]|\bissue #?\d+\b|shared/(?:spec|netemu|design)")
    hits = [(str(p.relative_to(ROOT)), m.group(0)) for p in SOURCES if p.name != "test_docs.py"
            for m in outside.finditer(p.read_text())]
    assert not hits, hits


LIBRARY = [p for d in ("hvd_commopt", "torch_plugin", "tf_plugin") for p in (ROOT / d).rglob("*") if p.suffix in (".py", ".c", ".h")]


def test_library_cites_no_measurement_log() -> None:
    """Library code states its reasons in docs/ (docs/benchmarking.md for what measurements
    settled), never in the benchmarks' how-to, a run's outputs or a generated report."""
    log = re.compile(r"benchmarks/(?:README\.md|REPORT\.md|results)")
    hits = [(str(p.relative_to(ROOT)), m.group(0)) for p in LIBRARY for m in log.finditer(p.read_text())]
    assert not hits, hits
