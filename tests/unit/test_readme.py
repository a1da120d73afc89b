"""CI must run the README's test command, verbatim."""
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci = [ln for ln in (ROOT / ".ci" / "run").read_text().splitlines() if ln and not ln.startswith("#")]
    command = ci[-1]
    assert command in readme, f"the README does not contain .ci/run's command: {command}"
    assert "-m pytest" in command and "pip install" in command and "venv" in command
