"""The backend follows the tensors: the one choice in runtime.choose_backend, its overrides, the
errors for a backend this process cannot run, and the wrap-time device check across ranks."""
import sys

import pytest

torch = pytest.importorskip("torch")

import torch_plugin as hco  # noqa: E402,F401  (registers gloo/nccl)
from hvd_commopt import env, run_ranks, runtime  # noqa: E402
from hvd_commopt.comm import _FACTORIES, create_backend  # noqa: E402
from hvd_commopt.errors import ConfigError, LaunchEnvironmentError, RankMismatchError  # noqa: E402
from torch_plugin.comm import TorchDistBackend, native_backend  # noqa: E402
from torch_plugin.devices import check_devices  # noqa: E402


def launch(launcher):
    """Rank 0 of 2, one rank per host (local size 1)."""
    return env.LaunchInfo(0, 1, 0, 1, "none") if launcher == "none" else env.LaunchInfo(0, 2, 0, 1, launcher)


@pytest.mark.parametrize("launcher", ["openmpi", "mpich", "torchrun", "horovodrun"])
def test_torch_tensors_get_their_own_collectives_under_every_launcher(monkeypatch, launcher):
    monkeypatch.delenv("HVD_COMMOPT_BACKEND", raising=False)
    name, why = runtime.choose_backend(launch(launcher), native="gloo")
    assert name == "gloo" and launcher in why
    assert runtime.choose_backend(launch(launcher), native="nccl")[0] == "nccl"


def test_cpu_tensors_with_every_rank_on_one_host_take_mpis_shared_memory(monkeypatch):
    monkeypatch.delenv("HVD_COMMOPT_BACKEND", raising=False)
    one_host = env.LaunchInfo(0, 2, 0, 2, "openmpi")
    name, why = runtime.choose_backend(one_host, native="gloo")
    assert name == "mpi" and "one host" in why
    assert runtime.choose_backend(env.LaunchInfo(0, 4, 0, 2, "openmpi"), native="gloo")[0] == "gloo"  # two hosts
    assert runtime.choose_backend(one_host, native="nccl")[0] == "nccl"  # CUDA tensors stay on the device
    assert runtime.choose_backend(env.LaunchInfo(0, 2, 0, 2, "torchrun"), native="gloo")[0] == "gloo"


def test_frameworks_without_native_collectives_keep_mpi(monkeypatch):
    monkeypatch.delenv("HVD_COMMOPT_BACKEND", raising=False)
    assert runtime.choose_backend(launch("openmpi"))[0] == "mpi"
    assert runtime.choose_backend(launch("horovodrun"))[0] == "mpi"
    assert runtime.choose_backend(launch("torchrun"))[0] == "gloo"
    assert runtime.choose_backend(launch("none"), native="gloo")[0] == "local"


def test_argument_then_environment_override_the_choice(monkeypatch):
    monkeypatch.setenv("HVD_COMMOPT_BACKEND", "mpi")
    assert runtime.choose_backend(launch("openmpi"), native="gloo") == ("mpi", "asked for by HVD_COMMOPT_BACKEND")
    assert runtime.choose_backend(launch("openmpi"), "gloo", native="gloo") == ("gloo", "asked for by init(backend=...)")


def test_native_default_is_nccl_exactly_when_cuda_is_there():
    assert native_backend() == ("nccl" if torch.cuda.is_available() else "gloo")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: NCCL is a valid choice here")
def test_nccl_without_cuda_names_the_alternatives():
    with pytest.raises(LaunchEnvironmentError, match=r"needs CUDA.*choose 'gloo'.*or 'mpi'"):
        TorchDistBackend("nccl")


def test_gloo_without_the_torch_adapter_names_what_to_install(monkeypatch):
    monkeypatch.delitem(_FACTORIES, "gloo")
    with pytest.raises(ConfigError, match=r"needs PyTorch: pip install torch.*HVD_COMMOPT_BACKEND=mpi"):
        create_backend("gloo")


def test_mpi_without_mpi4py_names_what_to_install(monkeypatch):
    from hvd_commopt.comm.mpi import import_mpi
    monkeypatch.setitem(sys.modules, "mpi4py", None)  # import fails as if not installed
    with pytest.raises(LaunchEnvironmentError, match=r"pip install 'hvd_commopt\[mpi\]'.*HVD_COMMOPT_BACKEND=gloo"):
        import_mpi()


def _model(device):
    return list(torch.nn.Linear(3, 2, device=device).named_parameters())


def test_same_device_type_on_every_rank_passes():
    assert run_ranks(2, lambda c: check_devices(c, _model("cpu"))) == ["cpu", "cpu"]


def test_rank_on_another_device_type_is_refused_on_every_rank_naming_the_tensor():
    # "meta" stands for a second device type (no data is touched): rank 1 differs from rank 0
    def body(c):
        with pytest.raises(RankMismatchError) as e:
            check_devices(c, _model("cpu" if c.rank == 0 else "meta"))
        return str(e.value)
    msgs = run_ranks(2, body)
    assert msgs[0] == msgs[1]
    assert "tensor 'weight' is on meta on rank 1 but the parameters are on cpu on rank 0" in msgs[0]


def test_parameters_spread_over_device_types_on_one_rank_are_refused():
    named = _model("cpu")[:1] + [("other.bias", torch.zeros(2, device="meta"))]
    with pytest.raises(ConfigError, match=r"several device types \('weight' on cpu, 'other.bias' on meta\)"):
        run_ranks(1, lambda c: check_devices(c, named))


def test_wrapping_checks_devices_across_ranks():
    def body(c):
        m = torch.nn.Linear(3, 2, device="cpu" if c.rank == 0 else "meta")
        with pytest.raises(RankMismatchError, match="is on meta on rank 1"):
            hco.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), named_parameters=m.named_parameters(),
                                     communicator=c)
    run_ranks(2, body)
