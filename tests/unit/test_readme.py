"""CI must run the README's test command, verbatim, and with its tiers cover the whole suite; the
README gives the two commands, which install the CPU builds pinned for the dev/CI machines next to
the package's framework ranges (setup.py, docs/versions.md#supported-versions)."""
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README_TEST = ".venv/bin/python -m pytest -q -rs"
# the README's two commands, exactly
MAIN_COMMAND = ("python3 -m venv .venv && .venv/bin/pip install -q torch==2.13.0 -e '.[torch,mpi,examples]' && "
                ".venv/bin/python -m hvd_commopt.run -np 2 .venv/bin/python examples/pytorch_digits.py")
TEST_COMMAND = ("python3 -m venv .venv && .venv/bin/pip install -q torch==2.13.0 tensorflow-cpu==2.21.0 -e '.[all]' && "
                + README_TEST)


def test_the_readme_gives_the_two_commands():
    readme = (ROOT / "README.md").read_text()
    assert MAIN_COMMAND in readme and TEST_COMMAND in readme


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci = [ln for ln in (ROOT / ".ci" / "run").read_text().splitlines() if ln and not ln.startswith("#")]
    tiers = [ln for ln in ci if "-m pytest" in ln]
    first = tiers[0].split(' -m "not slow"')[0]
    assert first in readme and first.endswith(README_TEST), f"the README does not contain .ci/run's command: {first}"
    assert first == TEST_COMMAND
    # the two tiers are exactly the README's suite: not slow, then slow
    assert tiers[0] == first + ' -m "not slow"' and tiers[1] == README_TEST + " -m slow" and len(tiers) == 2
