"""A failing or departing rank ends the whole job within seconds, under mpirun and our launcher.

Each scenario runs tests/parallel/mpi_faults.py on real ranks. The collective timeout stays at
120 s (run_mpi's default), so a job that ends within 10 s of the failure was ended by the
failure notice, not by the timeout. Times are measured from the timestamp the failing rank
prints just before it fails to the moment the launcher returns.
"""
import os
import re
import subprocess
import sys
import time

import pytest

from tests.parallel.launch import ROOT, run_mpi

pytest.importorskip("torch")
pytest.importorskip("mpi4py")

SCRIPT = str(ROOT / "tests/parallel/mpi_faults.py")
LIMIT_S = 10.0


def run_job(args, np=2, launcher=False, env=None):
    """(exit code, stdout + stderr, time the launcher returned) of mpi_faults.py ``args``."""
    if not launcher:
        proc = run_mpi(np, [sys.executable, SCRIPT, *args], timeout=240, env=env, check=False)
    else:
        # No "python" before the script: the launcher runs a .py with its own interpreter.
        full = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
                    OMP_NUM_THREADS="1", HVD_COMMOPT_TIMEOUT="120", **(env or {}))
        proc = subprocess.run([sys.executable, "-m", "hvd_commopt.run", "-np", str(np), SCRIPT, *args],
                              cwd=ROOT, env=full, capture_output=True, text=True, timeout=240)
    return proc.returncode, proc.stdout + proc.stderr, time.time()


def assert_ended_by(rc, out, ended, failed, event, reporters, why):
    """Non-zero exit within LIMIT_S of ``event`` on rank ``failed``, every reporter naming it."""
    assert rc != 0, out
    at = float(re.search(rf"rank {failed}: {event} at t=([0-9.]+)", out).group(1))
    assert ended - at < LIMIT_S, f"the job lived {ended - at:.1f}s after rank {failed}'s {event}:\n{out[-5000:]}"
    for r in reporters:
        assert re.search(rf"RankFailedError: rank {r}: allreduce '[^']+' cannot complete: rank {failed} {why}", out), \
            f"rank {r} does not name rank {failed}:\n{out[-5000:]}"
    return ended - at


@pytest.mark.slow
def test_exception_on_rank_1_ends_the_job_and_every_rank_names_it():
    rc, out, ended = run_job(["raise", "1"], np=3)
    took = assert_ended_by(rc, out, ended, 1, "raising", [0, 2], "failed with ValueError: boom on rank 1")
    assert "Traceback (most recent call last)" in out and "ValueError: boom on rank 1" in out, out
    assert "hvd_commopt: rank 1: uncaught ValueError; ending the job on all 3 ranks" in out, out
    print(f"exception -> end of job: {took:.2f}s")


@pytest.mark.slow
def test_exception_on_rank_0_ends_the_job():
    rc, out, ended = run_job(["raise", "0"])
    took = assert_ended_by(rc, out, ended, 0, "raising", [1], "failed with ValueError: boom on rank 0")
    assert "ValueError: boom on rank 0" in out, out
    print(f"exception -> end of job: {took:.2f}s")


@pytest.mark.slow
def test_traceback_shown_when_torch_distributed_wrapped_our_hook():
    """torch.distributed.init_process_group after init() wraps our exception hook in one that
    buffers stderr while ours runs (docs/usage.md#captured-stderr): the traceback still shows."""
    rc, out, ended = run_job(["raise_after_dist_init", "1"])
    assert_ended_by(rc, out, ended, 1, "raising", [0], "failed with ValueError: boom on rank 1")
    assert "Traceback (most recent call last)" in out and "ValueError: boom on rank 1" in out, out
    assert "hvd_commopt: rank 1: uncaught ValueError; ending the job on all 2 ranks" in out, out


@pytest.mark.slow
def test_backward_passes_per_step_misuse_on_one_rank_ends_the_job():
    rc, out, ended = run_job(["bpps"])
    assert_ended_by(rc, out, ended, 1, "second backward", [0],
                    "failed with HvdCommoptError: gradient of '[^']+' was computed more than backward_passes_per_step=1")


@pytest.mark.slow
def test_rank_ending_its_script_early_ends_the_job():
    rc, out, ended = run_job(["exit_early"])
    took = assert_ended_by(rc, out, ended, 1, "leaving", [0], r"ended its script \(after \d+ collectives")
    assert "rank 1: end of script after 3 steps" in out, out
    assert "same number of steps" in out, out  # the message names the fix
    print(f"early exit -> end of job: {took:.2f}s")


@pytest.mark.slow
@pytest.mark.parametrize("scenario", [("raise", "1"), ("exit_early",)])
def test_same_under_our_launcher(scenario):
    rc, out, ended = run_job(list(scenario), launcher=True)
    if scenario[0] == "raise":
        assert "ValueError: boom on rank 1" in out, out
        assert_ended_by(rc, out, ended, 1, "raising", [0], "failed with ValueError")
    else:
        assert_ended_by(rc, out, ended, 1, "leaving", [0], "ended its script")


@pytest.mark.slow
def test_ranks_finishing_at_different_times_still_exit_0_promptly():
    # Rank 0 works 3 s longer without collectives (a checkpoint): not a failure.
    rc, out, ended = run_job(["finish"])
    assert rc == 0, out
    done = float(re.search(r"rank 0: done at t=([0-9.]+)", out).group(1))
    assert ended - done < LIMIT_S, f"the job took {ended - done:.1f}s to end after the last rank was done"
    assert "RankFailedError" not in out, out


@pytest.mark.slow
def test_timeout_in_different_collectives_says_which_rank_is_in_which():
    # Seen by asking the peers where they wait (docs/horovod_api.md#one-rank-step), well before
    # the timeout, which is now the default 300 s (the job ends within run_job's 240 s)
    rc, out, ended = run_job(["mismatch"], env={"HVD_COMMOPT_TIMEOUT": "300"})
    assert rc != 0, out
    assert re.search(r"rank 0: allgather_object 'allgather_object' cannot complete: every rank waits in a collective "
                     r"that not every rank is in \(rank 1 waits in its collective #\d+ allreduce 'bucket0[^;]*; rank 0 "
                     r"waits in its collective #\d+ allgather_object 'negotiate'\)", out), out
    assert "only some ranks run" in out and "instead of the 300 s timeout" in out, out
    assert "every rank is inside it" not in out, out


@pytest.mark.slow
def test_bad_timeout_variable_fails_every_rank_at_init_without_hanging():
    t0 = time.time()
    rc, out, ended = run_job(["init_only"], env={"HVD_COMMOPT_TIMEOUT": "abc"})
    assert rc != 0, out
    assert "ConfigError: environment variable HVD_COMMOPT_TIMEOUT='abc' is not a number of seconds" in out, out
    assert "initialised" not in out, out
    assert ended - t0 < 120, out


@pytest.mark.slow
@pytest.mark.parametrize("lane", ["0", "65536"])
@pytest.mark.parametrize("scenario", ["raise", "exit_early"])
def test_failures_are_named_over_the_mpi_control_plane_when_gloo_carries_the_data(scenario, lane):
    # docs/backends.md#control-plane: Gloo's broken connection becomes the notice naming the rank;
    # with the MPI lane (docs/backends.md#small-on-mpi) the small collectives block in MPI instead
    env = {"HVD_COMMOPT_BACKEND": "gloo", "HVD_COMMOPT_MPI_SMALL_BYTES": lane}
    if scenario == "raise":
        rc, out, ended = run_job(["raise", "1"], env=env)
        assert_ended_by(rc, out, ended, 1, "raising", [0], "failed with ValueError: boom on rank 1")
    else:
        rc, out, ended = run_job(["exit_early"], env=env)
        assert_ended_by(rc, out, ended, 1, "leaving", [0], r"ended its script \(after \d+ collectives")
