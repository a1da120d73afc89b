"""CI must run the README's test command, verbatim, and with its tiers cover the whole suite."""
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README_TEST = ".venv/bin/python -m pytest -q -rs"


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci = [ln for ln in (ROOT / ".ci" / "run").read_text().splitlines() if ln and not ln.startswith("#")]
    tiers = [ln for ln in ci if "-m pytest" in ln]
    first = tiers[0].split(' -m "not slow"')[0]
    assert first in readme and first.endswith(README_TEST), f"the README does not contain .ci/run's command: {first}"
    assert "pip install" in first and "venv" in first
    # the two tiers are exactly the README's suite: not slow, then slow
    assert tiers[0] == first + ' -m "not slow"' and tiers[1] == README_TEST + " -m slow" and len(tiers) == 2
