"""``python -m hvd_commopt.run -H a:2,b:2`` across two emulated hosts (benchmarks/netemu.py: one
network namespace per host, a shaped link between them) trains as ``mpirun -np 4`` does on one
host: the default backend (Gloo, MPI as control plane) finds its rendezvous over MPI, binds Gloo to
the emulated link, and every rank ends with the same weights as a single-host run on Gloo. Skips where
namespaces are impossible (needs root and iproute2), with the reason the tool reports."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.parallel.launch import ROOT, run_mpi
from tests.parallel.test_launchers import SCRIPT, _weights

pytest.importorskip("torch")
pytest.importorskip("mpi4py")
sys.path.insert(0, str(ROOT / "benchmarks"))
import netemu  # noqa: E402
from netemu_support import RSH_SCRIPT  # noqa: E402  (put on sys.path by netemu)


def test_our_launcher_across_emulated_hosts_equals_mpirun_on_one_host():
    try:
        netemu.find_mpi("openmpi")
    except netemu.NetemuError as e:
        pytest.skip(str(e))
    with netemu.EmulatedCluster(n=2, rate="1gbit", mpi="openmpi") as cl:
        if not cl.netns:
            pytest.skip(f"network namespaces unavailable: {cl.fallback_reason}")
        work = Path(cl._require_up())
        rsh = work / "netns-rsh"
        shutil.copyfile(RSH_SCRIPT, rsh)  # a private executable copy: git may not keep the x bit
        rsh.chmod(0o755)
        net = f"{cl.subnet}.0/24"
        # Open MPI reads MCA settings from the environment (PRTE_MCA_* for the launch, OMPI_MCA_*
        # for the ranks, forwarded by mpirun): the daemons start through the namespaces' fake ssh
        # and MPI's own TCP stays on the emulated subnet.
        env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", HVD_COMMOPT_TIMEOUT="120",
                   HVD_NETEMU_PREFIX=cl.prefix, PRTE_MCA_plm_ssh_agent=str(rsh), PRTE_MCA_oob_tcp_if_include=net,
                   OMPI_MCA_btl="tcp,self", OMPI_MCA_btl_tcp_if_include=net, OMPI_MCA_mpi_yield_when_idle="1")
        for k in ("HVD_COMMOPT_BACKEND", "MASTER_ADDR", "MASTER_PORT", "GLOO_SOCKET_IFNAME"):
            env.pop(k, None)
        hosts = ",".join(f"{h}:2" for h in cl.hosts)
        argv = cl.host_argv(0, [sys.executable, "-m", "hvd_commopt.run", "-np", "4", "-H", hosts, "--verbose", SCRIPT])
        proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 0, out[-4000:]
        links = cl.counters()
    across = _weights(out, 4)
    assert {v[:2] for v in across.values()} == {("gloo", "mpi")}, out[-3000:]
    # the gradients crossed the emulated link (Gloo bound to veth0, not a real interface)
    assert all(c["tx_bytes"] > 0 for c in links.values()), links
    # the one-host reference on the same transports (its default there is MPI alone, whose 4-rank
    # sums of the larger buffers round in another order: docs/backends.md#one-host): Gloo, and the
    # MPI lane for the small collectives, which across hosts the runtime's choice opens by itself
    # (docs/backends.md#small-on-mpi)
    assert "CPU collectives of <= 65536 bytes per rank over MPI" in out, out[-3000:]
    local = _weights(run_mpi(4, [sys.executable, SCRIPT], timeout=240,
                             env={"HVD_COMMOPT_BACKEND": "gloo", "HVD_COMMOPT_MPI_SMALL_BYTES": "65536"}).stdout, 4)
    assert len({v[2] for v in across.values()} | {v[2] for v in local.values()}) == 1, (across, local)
