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
