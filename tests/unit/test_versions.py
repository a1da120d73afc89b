"""setup.py requires framework ranges, not pins (docs/versions.md#supported-versions): an install
next to the torch a user already has (2.4 with CUDA, say) keeps it, and no extra names a
TensorFlow distribution (tensorflow and tensorflow-cpu share one import package)."""
from __future__ import annotations

import ast
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]


def _extras() -> dict[str, list[Requirement]]:
    """setup.py's module-level requirement lists, by name (read without running setup())."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    out = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.List):
            out[node.targets[0].id] = [Requirement(s) for s in ast.literal_eval(node.value)]
    return out


def test_torch_is_a_range_that_keeps_the_torch_a_user_has():
    (torch,) = _extras()["TORCH"]
    assert torch.name == "torch" and not any(s.operator in ("==", "===", "~=") for s in torch.specifier)
    for have in ("2.3.0", "2.4.1", "2.11.0", "2.13.0", "2.14.1", "2.13.0+cpu", "2.11.0+cu128"):
        assert torch.specifier.contains(Version(have)), have
    assert not torch.specifier.contains(Version("2.2.2"))  # no torch.uint16


def test_no_extra_names_a_tensorflow_distribution():
    extras = _extras()
    names = {r.name for reqs in extras.values() for r in reqs}
    assert not names & {"tensorflow", "tensorflow-cpu", "tf-nightly"}
    (keras,) = extras["TF"]
    assert keras.name == "keras" and keras.specifier.contains(Version("3.15.1"))
    assert not keras.specifier.contains(Version("2.15.0"))  # Keras 3: TensorFlow >= 2.16


def test_the_installed_frameworks_satisfy_the_ranges():
    from importlib.metadata import PackageNotFoundError, version
    for req in _extras()["TORCH"] + _extras()["TF"]:
        try:
            have = version(req.name)
        except PackageNotFoundError:
            continue
        assert req.specifier.contains(Version(have)), (req, have)
