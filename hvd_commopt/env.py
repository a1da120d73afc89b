"""The only place that reads ``os.environ``: typed getters for deployment knobs and launch detection.

(Two writes that configure a library we start stay where they happen, each with its reason:
Open MPI's yield setting in comm/mpi.py and Gloo's interface in torch_plugin/rendezvous.py.)

An explicit argument always wins over an environment variable; an environment variable wins over
the default. ``HOROVOD_*`` spellings of the same knob are honoured so that a Horovod job script
keeps working after changing one import.
"""
from __future__ import annotations

import datetime
import math
import numbers
import os
from dataclasses import dataclass

from .errors import ConfigError, LaunchEnvironmentError

__all__ = [
    "LaunchInfo",
    "detect_launch",
    "backend_name",
    "fusion_threshold_bytes",
    "fusion_threshold_setting",
    "collective_timeout_s",
    "timeline_path",
    "verbose",
    "mpi_small_bytes",
    "torch_rendezvous_vars",
    "gloo_socket_ifname",
    "DEFAULT_FUSION_THRESHOLD",
    "DEFAULT_TIMEOUT_S",
]

# Not Horovod's 128 MiB: Horovod fuses, each 1-5 ms cycle, whatever tensors are ready by then,
# so a large cap still overlaps with backward. Our buckets are planned statically (so that all
# ranks issue the same collectives without negotiating); with a 128 MiB cap a ResNet-18 becomes
# one bucket that starts after backward ends (measured: 189 ms of unoverlapped wait per step on
# 2 CPU ranks). DDP's bucket_cap_mb default of 25 MiB gives overlap; fusion="mgwfbp" plans better.
DEFAULT_FUSION_THRESHOLD = 25 * 1024 * 1024
# Long enough for a slow first step (allocation, profiling), short enough that a lost rank is
# reported within minutes rather than never.
DEFAULT_TIMEOUT_S = 300.0


def _get(*names: str) -> str | None:
    for n in names:
        v = os.environ.get(n)
        if v is not None and v != "":
            return v
    return None


def _number(value: str, name: str, kind=float):
    try:
        return kind(value)
    except ValueError:
        raise ConfigError(f"environment variable {name}={value!r} is not a number; unset it or give a number") from None


def fusion_threshold_bytes(explicit: int | None = None) -> int:
    """Fusion threshold in bytes (0 = one tensor per message), Horovod's meaning."""
    return fusion_threshold_setting(explicit)[0]


def fusion_threshold_setting(explicit: int | None = None) -> tuple[int, str]:
    """``(bytes, where it came from)``: the argument ``"fusion_threshold="``, the variable's name,
    or ``"default"``. The source is named when ranks disagree (docs/cross-rank-check.md#settings).

    Raises:
        ConfigError: not a whole number of bytes >= 0 (e.g. ``'25MB'``), with the fix.
    """
    if explicit is not None:
        return _whole_bytes(explicit, f"fusion_threshold={explicit!r}"), "fusion_threshold="
    for name in ("HVD_COMMOPT_FUSION_THRESHOLD", "HOROVOD_FUSION_THRESHOLD"):
        v = _get(name)
        if v is not None:
            try:
                out = int(v)
            except ValueError:
                raise ConfigError(f"environment variable {name}={v!r} is not a number: give a whole number of bytes, e.g. "
                                  f"{name}={DEFAULT_FUSION_THRESHOLD} (25 MiB), 0 to disable fusion, or unset "
                                  f"it") from None
            if out < 0:
                raise ConfigError(f"environment variable {name}={v!r} is negative; use 0 to disable fusion")
            return out, name
    return DEFAULT_FUSION_THRESHOLD, "default"


def _whole_bytes(value: object, what: str) -> int:
    # Strings are refused, not parsed ('25MB' has no one meaning: MB or MiB); so are fractions.
    ok = isinstance(value, numbers.Integral) or (isinstance(value, numbers.Real) and float(value).is_integer())
    if isinstance(value, bool) or not ok:
        raise ConfigError(f"{what} is not a whole number of bytes: pass an int, e.g. fusion_threshold="
                          f"25 * 1024 * 1024 (25 MiB), or 0 to send each tensor on its own")
    whole = int(value)  # type: ignore[call-overload]  # an Integral or a whole Real, checked above
    if whole < 0:
        raise ConfigError(f"{what} is negative: pass a number of bytes >= 0 (0 sends each tensor on its own)")
    return whole


def collective_timeout_s(explicit: float | datetime.timedelta | None = None) -> float:
    """Seconds a blocking wait may last before it fails with CollectiveTimeoutError.

    ``explicit`` is ``init(timeout_s=...)``: a number of seconds, or a ``datetime.timedelta``
    (what ``torch.distributed.init_process_group(timeout=...)`` takes). Strings are refused
    rather than parsed: a string there is a mistake (a config value not converted), not a choice.
    It must be finite: "never time out" would let a lost rank hang the job forever.
    """
    if explicit is not None:
        what = f"timeout_s={explicit!r}"
        if isinstance(explicit, datetime.timedelta):
            out = explicit.total_seconds()
        elif isinstance(explicit, numbers.Real) and not isinstance(explicit, bool):
            out = float(explicit)
        else:
            raise ConfigError(f"{what} is not a number of seconds: pass a number, e.g. "
                              f"init(timeout_s=300), or leave it out (HVD_COMMOPT_TIMEOUT, default "
                              f"{DEFAULT_TIMEOUT_S:g} s)")
    else:
        v = _get("HVD_COMMOPT_TIMEOUT")
        what = f"HVD_COMMOPT_TIMEOUT={v!r}"
        if v is None:
            out = DEFAULT_TIMEOUT_S
        else:
            try:
                out = float(v)
            except ValueError:
                raise ConfigError(f"environment variable {what} is not a number of seconds: set e.g. "
                                  f"HVD_COMMOPT_TIMEOUT=300, or unset it (default {DEFAULT_TIMEOUT_S:g} s)") from None
    if not (0 < out < math.inf):  # also refuses nan
        raise ConfigError(f"collective timeout must be a finite number of seconds > 0, got {what}; "
                          f"e.g. {DEFAULT_TIMEOUT_S:g}")
    return out


def timeline_path(explicit: str | None = None) -> str | None:
    return explicit if explicit is not None else _get("HVD_COMMOPT_TIMELINE", "HOROVOD_TIMELINE")


def verbose() -> bool:
    return (_get("HVD_COMMOPT_VERBOSE") or "0") not in ("0", "false", "False", "")


def torch_rendezvous_vars() -> bool:
    """Whether MASTER_ADDR and MASTER_PORT are both set: torch.distributed's ``env://`` rendezvous
    (torchrun sets them) rather than ours over MPI (docs/backends.md#control-plane)."""
    return "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ


def gloo_socket_ifname() -> str | None:
    """GLOO_SOCKET_IFNAME, the interface the user bound Gloo to (None: unset; then the rendezvous
    binds Gloo to the interface that reaches rank 0, docs/backends.md#control-plane)."""
    return os.environ.get("GLOO_SOCKET_IFNAME")


#: the largest collective (bytes per rank) that a Gloo group chosen under an MPI launcher sends over
#: MPI instead (docs/backends.md#small-on-mpi)
DEFAULT_MPI_SMALL_BYTES = 64 * 1024


def mpi_small_bytes(chosen: bool, explicit: int | None = None) -> int:
    """HVD_COMMOPT_MPI_SMALL_BYTES: the largest CPU collective (bytes each rank sends) that the
    Gloo backend carries over MPI when MPI is its control plane (docs/backends.md#small-on-mpi);
    0 keeps everything on Gloo. Default: DEFAULT_MPI_SMALL_BYTES where the backend was ``chosen``
    by us, 0 where the user named it. ``explicit`` (the backend's argument) wins."""
    if explicit is not None:
        if isinstance(explicit, bool) or not isinstance(explicit, numbers.Integral) or explicit < 0:
            raise ConfigError(f"mpi_small_bytes={explicit!r}: give a whole number of bytes >= 0, or 0 to keep "
                              f"small collectives on Gloo")
        return int(explicit)
    v = _get("HVD_COMMOPT_MPI_SMALL_BYTES")
    if v is None:
        return DEFAULT_MPI_SMALL_BYTES if chosen else 0
    try:
        out = int(v)
    except ValueError:
        out = -1
    if out < 0:
        raise ConfigError(f"environment variable HVD_COMMOPT_MPI_SMALL_BYTES={v!r}: give a whole number of bytes "
                          f">= 0, e.g. {DEFAULT_MPI_SMALL_BYTES} (the default), or 0 to keep small collectives "
                          f"on Gloo")
    return out


def backend_name(explicit: str | None = None) -> str | None:
    """The backend asked for by argument or HVD_COMMOPT_BACKEND; None means 'choose from the launcher'."""
    return explicit or _get("HVD_COMMOPT_BACKEND")


@dataclass(frozen=True)
class LaunchInfo:
    """Where this process sits in the job, as told by the launcher's environment."""

    rank: int
    size: int
    local_rank: int
    local_size: int
    launcher: str  # "openmpi", "mpich", "horovodrun", "torchrun", "slurm" or "none"


# (launcher, rank var, size var, local rank var, local size var), in the order they are trusted.
_LAUNCHERS = (
    ("openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
     "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("mpich", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    ("horovodrun", "HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE"),
    ("torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"),
)


def detect_launch(environ: dict[str, str] | None = None) -> LaunchInfo:
    """Read rank/size from every launcher's variables and check that they agree.

    Raises:
        LaunchEnvironmentError: two launchers' variables disagree (for instance a stale
            ``RANK``/``WORLD_SIZE`` exported in a shell, then ``mpirun`` started the job), naming
            both sources so the user knows which one to unset.
    """
    env = os.environ if environ is None else environ
    found: list[tuple[str, int, int, int | None, int | None]] = []
    for launcher, rv, sv, lrv, lsv in _LAUNCHERS:
        if rv in env and sv in env:
            try:
                r, s = int(env[rv]), int(env[sv])
                lr = int(env[lrv]) if lrv in env else None
                ls = int(env[lsv]) if lsv in env else None
            except ValueError:
                raise LaunchEnvironmentError(
                    f"{launcher} variables {rv}={env.get(rv)!r} {sv}={env.get(sv)!r} are not integers") from None
            if not (0 <= r < s):
                raise LaunchEnvironmentError(f"{launcher} says rank {r} of size {s}: rank must be in [0, size)")
            found.append((launcher, r, s, lr, ls))
    if not found:
        return LaunchInfo(0, 1, 0, 1, "none")
    first = found[0]
    for other in found[1:]:
        if (other[1], other[2]) != (first[1], first[2]):
            raise LaunchEnvironmentError(
                f"launchers disagree: {first[0]} says rank {first[1]} of {first[2]}, "
                f"{other[0]} says rank {other[1]} of {other[2]}. Unset the stale variables "
                f"(e.g. RANK/WORLD_SIZE left in the shell) or launch with one launcher only.")
    launcher, r, s, lr, ls = first
    return LaunchInfo(r, s, lr if lr is not None else r, ls if ls is not None else s, launcher)
