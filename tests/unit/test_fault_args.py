"""Arguments of init() and the launcher: one clear error naming the fix, or a documented behaviour."""
import datetime
import sys

import numpy as np
import pytest

from hvd_commopt import env, faults, run, runtime
from hvd_commopt.errors import ConfigError

_LAUNCH_VARS = ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_RANK", "PMI_SIZE", "HOROVOD_RANK",
                "HOROVOD_SIZE", "RANK", "WORLD_SIZE", "HVD_COMMOPT_BACKEND", "HVD_COMMOPT_TIMEOUT")


@pytest.fixture
def fresh_runtime(monkeypatch):
    for v in _LAUNCH_VARS:
        monkeypatch.delenv(v, raising=False)
    runtime.shutdown()  # an earlier test in this process may have initialised it
    yield
    runtime.shutdown()


@pytest.mark.parametrize("bad", ["abc", "30", True, [5]])
def test_timeout_argument_that_is_not_a_number_names_the_fix(bad):
    with pytest.raises(ConfigError, match=r"timeout_s=.* is not a number of seconds: pass a number, e\.g\. init\(timeout_s=300\)"):
        env.collective_timeout_s(bad)


@pytest.mark.parametrize("bad", [0, -1, float("nan"), float("inf"), datetime.timedelta(0)])
def test_timeout_must_be_finite_and_positive(bad):
    with pytest.raises(ConfigError, match="finite number of seconds > 0"):
        env.collective_timeout_s(bad)


def test_timeout_accepts_numbers_and_timedelta():
    assert env.collective_timeout_s(5) == 5.0
    assert env.collective_timeout_s(np.float32(2.5)) == 2.5
    assert env.collective_timeout_s(datetime.timedelta(minutes=2)) == 120.0  # torch.distributed's type


@pytest.mark.parametrize("value", ["abc", "nan", "inf", "-3"])
def test_bad_timeout_variable_names_it_and_the_fix(monkeypatch, value):
    monkeypatch.setenv("HVD_COMMOPT_TIMEOUT", value)
    with pytest.raises(ConfigError, match=rf"HVD_COMMOPT_TIMEOUT='{value}'.*(HVD_COMMOPT_TIMEOUT=300|e\.g\. 300)"):
        env.collective_timeout_s()


def test_init_refuses_a_bad_timeout_before_starting_anything(fresh_runtime):
    with pytest.raises(ConfigError, match="timeout_s='abc'"):
        runtime.init(timeout_s="abc")
    assert not runtime.is_initialized()


def test_second_init_with_other_settings_is_refused_same_settings_are_idempotent(fresh_runtime):
    comm = runtime.init()
    assert comm.timeout_s == env.DEFAULT_TIMEOUT_S
    assert runtime.init() is comm  # Horovod: a library and the script may both call init()
    assert runtime.init(timeout_s=env.DEFAULT_TIMEOUT_S) is comm
    assert runtime.init(backend="local") is comm
    with pytest.raises(ConfigError, match=r"init\(timeout_s=5\) but hvd_commopt is already initialised with "
                                          r"timeout_s=300; .*call shutdown\(\) before init\(\)"):
        runtime.init(timeout_s=5)
    with pytest.raises(ConfigError, match=r"init\(backend='mpi'\) but .* backend 'local'"):
        runtime.init(backend="mpi")
    with pytest.raises(ConfigError, match="timeout_s='abc'"):  # checked on later calls too
        runtime.init(timeout_s="abc")
    assert runtime.communicator() is comm
    runtime.shutdown()
    assert runtime.init(timeout_s=5).timeout_s == 5.0


def test_single_rank_keeps_the_default_excepthook(fresh_runtime):
    runtime.init()
    assert sys.excepthook is not faults._excepthook


def test_end_of_job_message_prints_what_an_outer_hook_buffered(monkeypatch):
    """torch.distributed's exception hook runs ours with sys.stderr pointed at a StringIO that it
    prints after ours returns; ours never returns, so it prints the buffer (docs/usage.md#captured-stderr)."""
    import io
    real, captured = io.StringIO(), io.StringIO("Traceback ...\nValueError: boom\n")
    captured.seek(0, io.SEEK_END)
    monkeypatch.setattr(sys, "__stderr__", real)
    monkeypatch.setattr(sys, "stderr", captured)
    assert faults._real_stderr() is real
    assert real.getvalue() == "Traceback ...\nValueError: boom\n" and captured.getvalue() == ""
    # a stderr the script redirected elsewhere (a file, a logger) is where the message goes
    monkeypatch.setattr(sys, "stderr", own := io.TextIOWrapper(io.BytesIO()))
    assert faults._real_stderr() is own


def _build(argv):
    args = run._parser().parse_args(["--mpirun", "/x/mpirun"] + argv)
    return run.build_command(args, {"PATH": "/bin"})


def test_launcher_runs_a_python_script_with_its_own_interpreter(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    cmd, _ = _build(["-np", "2", str(script), "--lr", "1"])
    assert cmd[-4:] == [sys.executable, str(script), "--lr", "1"]
    cmd, _ = _build(["-np", "2", "python3", str(script)])  # an explicit interpreter is kept
    assert cmd[-2:] == ["python3", str(script)]


def test_launcher_refuses_a_missing_script_and_a_bad_timeout(tmp_path, capsys):
    with pytest.raises(ConfigError, match=r"script 'nope\.py' not found .*give its path"):
        _build(["-np", "2", "nope.py"])
    cmd, _ = _build(["-np", "2", "-H", "a:1,b:1", "remote.py"])  # may exist only on the hosts
    assert cmd[-2:] == [sys.executable, "remote.py"]
    for bad in ("0", "-5", "nan", "inf"):
        with pytest.raises(ConfigError, match="--timeout must be a finite number of seconds > 0"):
            _build(["-np", "2", "--timeout", bad, "python", "t.py"])
    assert run.main(["--mpirun", "/x/mpirun", "-np", "2", "--dry-run", "nope.py"]) == 2
    assert "script 'nope.py' not found" in capsys.readouterr().err


# -- engine arguments (docs/cross-rank-check.md#arguments) -------------------------------------
from hvd_commopt import NumpyOps, build_engine, run_ranks  # noqa: E402
from hvd_commopt.engine.args import check_engine_args  # noqa: E402


@pytest.mark.parametrize("bad, match", [
    ("2", r"backward_passes_per_step='2' must be a whole number >= 1 .*e\.g\. backward_passes_per_step=2"),
    (1.5, r"backward_passes_per_step=1\.5 must be a whole number >= 1"),
    (True, r"backward_passes_per_step=True must be a whole number"),
    (0, r"backward_passes_per_step=0 must be >= 1: use 1 to reduce after every backward pass"),
    (-2, r"backward_passes_per_step=-2 must be >= 1"),
])
def test_backward_passes_per_step_is_a_whole_number_at_least_one(bad, match):
    with pytest.raises(ConfigError, match=match):
        check_engine_args(backward_passes_per_step=bad)
    with pytest.raises(ConfigError, match=match):  # the engine checks it the same way
        run_ranks(1, lambda comm: build_engine(comm, NumpyOps(), backward_passes_per_step=bad))


@pytest.mark.parametrize("bad, match", [
    ("25MB", r"fusion_threshold='25MB' is not a whole number of bytes: pass an int, e\.g\. fusion_threshold=25 \* 1024 \* 1024"),
    (1.5, r"fusion_threshold=1\.5 is not a whole number of bytes"),
    ([1024], r"fusion_threshold=\[1024\] is not a whole number of bytes"),
    (-1, r"fusion_threshold=-1 is negative: pass a number of bytes >= 0 \(0 sends each tensor on its own\)"),
])
def test_fusion_threshold_argument_is_whole_bytes(bad, match):
    with pytest.raises(ConfigError, match=match):
        check_engine_args(fusion_threshold=bad)
    with pytest.raises(ConfigError, match=match):
        run_ranks(1, lambda comm: build_engine(comm, NumpyOps(), fusion_threshold=bad))


def test_fusion_threshold_accepts_ints_and_integral_floats_and_names_its_source(monkeypatch):
    monkeypatch.delenv("HVD_COMMOPT_FUSION_THRESHOLD", raising=False)
    monkeypatch.delenv("HOROVOD_FUSION_THRESHOLD", raising=False)
    assert env.fusion_threshold_setting(np.int64(1024)) == (1024, "fusion_threshold=")
    assert env.fusion_threshold_setting(64 * 1024 * 1024.0) == (64 * 1024 * 1024, "fusion_threshold=")
    assert env.fusion_threshold_setting() == (env.DEFAULT_FUSION_THRESHOLD, "default")
    monkeypatch.setenv("HOROVOD_FUSION_THRESHOLD", "4096")
    assert env.fusion_threshold_setting() == (4096, "HOROVOD_FUSION_THRESHOLD")
    monkeypatch.setenv("HVD_COMMOPT_FUSION_THRESHOLD", "25MB")
    with pytest.raises(ConfigError, match=r"HVD_COMMOPT_FUSION_THRESHOLD='25MB' is not a number: give a whole "
                                          r"number of bytes, e\.g\. HVD_COMMOPT_FUSION_THRESHOLD=26214400"):
        env.fusion_threshold_setting()
    monkeypatch.setenv("HVD_COMMOPT_FUSION_THRESHOLD", "-5")
    with pytest.raises(ConfigError, match=r"HVD_COMMOPT_FUSION_THRESHOLD='-5' is negative; use 0"):
        env.fusion_threshold_setting()


@pytest.mark.parametrize("bad", ["2", float("nan"), float("inf"), 0, -1.0])
def test_gradient_predivide_factor_is_a_finite_positive_number(bad):
    with pytest.raises(ConfigError, match=r"gradient_predivide_factor.* > 0"):
        check_engine_args(gradient_predivide_factor=bad)


@pytest.mark.parametrize("root", [3, -1, 1])
def test_root_rank_outside_the_job_is_refused_at_size_one(root):
    def body(comm):
        from hvd_commopt import collectives
        with pytest.raises(ConfigError, match=rf"root_rank={root} is out of range: the job has 1 rank\(s\), "
                                              rf"numbered 0 to 0; pass root_rank= one of them \(usually 0\)"):
            collectives.broadcast(comm, NumpyOps(), np.zeros(3, np.float32), root)
        with pytest.raises(ConfigError, match=rf"root_rank={root} is out of range"):
            comm.broadcast_object("x", root)
        with pytest.raises(ConfigError, match=r"root_rank='0' must be an int rank in \[0, 1\), e\.g\. root_rank=0"):
            comm.broadcast_object("x", "0")
    run_ranks(1, body)


def test_root_rank_outside_the_job_is_refused_at_size_two():
    def body(comm):
        with pytest.raises(ConfigError, match=r"root_rank=2 is out of range: the job has 2 rank\(s\), numbered 0 to 1"):
            comm.broadcast_object("x", 2)
    run_ranks(2, body)
