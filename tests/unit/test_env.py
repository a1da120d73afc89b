import pytest

from hvd_commopt import env
from hvd_commopt.errors import ConfigError, LaunchEnvironmentError


def test_no_launcher_is_size_one():
    assert env.detect_launch({}) == env.LaunchInfo(0, 1, 0, 1, "none")


def test_openmpi_variables():
    info = env.detect_launch({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4",
                              "OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"})
    assert info == env.LaunchInfo(2, 4, 0, 2, "openmpi")


def test_mpich_and_torchrun_variables():
    assert env.detect_launch({"PMI_RANK": "1", "PMI_SIZE": "3"}).launcher == "mpich"
    info = env.detect_launch({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"})
    assert (info.rank, info.size, info.local_rank, info.launcher) == (1, 2, 1, "torchrun")


def test_agreeing_launchers_are_fine():
    info = env.detect_launch({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "RANK": "1", "WORLD_SIZE": "2"})
    assert info.launcher == "openmpi"


def test_disagreeing_launchers_name_both():
    with pytest.raises(LaunchEnvironmentError, match="openmpi says rank 1 of 2, torchrun says rank 0 of 4"):
        env.detect_launch({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "RANK": "0", "WORLD_SIZE": "4"})


def test_bad_rank_values():
    with pytest.raises(LaunchEnvironmentError, match="rank must be in"):
        env.detect_launch({"PMI_RANK": "3", "PMI_SIZE": "3"})
    with pytest.raises(LaunchEnvironmentError, match="not integers"):
        env.detect_launch({"PMI_RANK": "x", "PMI_SIZE": "3"})


def test_fusion_threshold_precedence(monkeypatch):
    monkeypatch.delenv("HVD_COMMOPT_FUSION_THRESHOLD", raising=False)
    monkeypatch.delenv("HOROVOD_FUSION_THRESHOLD", raising=False)
    assert env.fusion_threshold_bytes() == env.DEFAULT_FUSION_THRESHOLD
    monkeypatch.setenv("HOROVOD_FUSION_THRESHOLD", "1024")
    assert env.fusion_threshold_bytes() == 1024
    monkeypatch.setenv("HVD_COMMOPT_FUSION_THRESHOLD", "0")
    assert env.fusion_threshold_bytes() == 0
    assert env.fusion_threshold_bytes(77) == 77  # an argument wins
    monkeypatch.setenv("HVD_COMMOPT_FUSION_THRESHOLD", "big")
    with pytest.raises(ConfigError, match="not a number"):
        env.fusion_threshold_bytes()


def test_timeout_must_be_positive(monkeypatch):
    monkeypatch.setenv("HVD_COMMOPT_TIMEOUT", "0")
    with pytest.raises(ConfigError, match="> 0"):
        env.collective_timeout_s()
    assert env.collective_timeout_s(5) == 5.0


def test_mpi_lane_size_defaults_on_only_where_the_runtime_chose_gloo(monkeypatch):
    # docs/backends.md#small-on-mpi
    monkeypatch.delenv("HVD_COMMOPT_MPI_SMALL_BYTES", raising=False)
    assert env.mpi_small_bytes(chosen=True) == env.DEFAULT_MPI_SMALL_BYTES == 65536
    assert env.mpi_small_bytes(chosen=False) == 0  # the user named the backend: all on it
    monkeypatch.setenv("HVD_COMMOPT_MPI_SMALL_BYTES", "4096")
    assert env.mpi_small_bytes(chosen=False) == env.mpi_small_bytes(chosen=True) == 4096
    monkeypatch.setenv("HVD_COMMOPT_MPI_SMALL_BYTES", "0")
    assert env.mpi_small_bytes(chosen=True) == 0
    for bad in ("64KB", "-1", "1.5"):
        monkeypatch.setenv("HVD_COMMOPT_MPI_SMALL_BYTES", bad)
        with pytest.raises(ConfigError, match=r"HVD_COMMOPT_MPI_SMALL_BYTES=.*whole number of bytes >= 0.*0 to keep"):
            env.mpi_small_bytes(chosen=True)


def test_mpi_lane_size_given_to_the_backend_wins_over_the_environment(monkeypatch):
    # TorchDistBackend(mpi_small_bytes=...): the benchmarks' *_nolane backends (docs/backends.md#small-on-mpi)
    monkeypatch.setenv("HVD_COMMOPT_MPI_SMALL_BYTES", "4096")
    assert env.mpi_small_bytes(chosen=True, explicit=0) == 0
    assert env.mpi_small_bytes(chosen=False, explicit=100) == 100
    for bad in (-1, 1.5, True, "64KB"):
        with pytest.raises(ConfigError, match=r"mpi_small_bytes=.*whole number of bytes >= 0"):
            env.mpi_small_bytes(chosen=True, explicit=bad)


def test_torch_rendezvous_variables_are_read_here(monkeypatch):
    # docs/backends.md#control-plane: env:// when both are set, else our rendezvous over MPI
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert not env.torch_rendezvous_vars()
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    assert env.torch_rendezvous_vars()
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    assert env.gloo_socket_ifname() is None
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth1")
    assert env.gloo_socket_ifname() == "eth1"
