"""State that must agree across ranks after a load: fingerprints and their one-collective check
(docs/cross-rank-check.md#state).

The wrap-time checks (:mod:`hvd_commopt.engine.specs`) compare what decides the collectives. They
cannot see the *state* the optimizer starts from, which a checkpoint or a broadcast sets later:
momentum buffers, Adam moments, hyper-parameters, a compressor's memory. When that state differs
across ranks, nothing fails: the ranks apply different updates to the same reduced gradient and
drift apart (a renamed key in one rank's file, or a checkpoint loaded on rank 0 only without
``broadcast_optimizer_state``).

A state is described as a flat ``{path: entry}`` map (:func:`fingerprint`): every tensor is
``dtype[shape]`` and, where its value must be the same on every rank, a 16-byte BLAKE2b hash of its
bytes; every plain value is its ``repr``. Per-rank state (error-feedback residuals, DGC memory,
local optimizer state) legitimately differs in value, so only its structure is described (the
keys, shapes and dtypes). :func:`verify_same_state` then costs what the wrap-time check costs: one
allgather of a 32-byte digest; only when the digests differ are the maps exchanged, so that every
rank raises the same :class:`~hvd_commopt.errors.RankMismatchError` naming the first differing
entry and the fix.

Also here, because they are about the same loads and need no collective:
:func:`missing_compression_state` (a checkpoint without the compressor's memory loaded into a
compressed optimizer) and :func:`check_memory_shapes` (a residual whose size is not its bucket's,
refused at load time instead of at the first step).
"""
from __future__ import annotations

import hashlib
from typing import Any, Iterable, Mapping

import numpy as np

from .comm.communicator import Communicator
from .errors import ConfigError, RankMismatchError
from .tensor_ops import TensorOps

__all__ = ["fingerprint", "verify_same_state", "missing_compression_state", "check_memory_shapes"]

_PLAIN = (str, int, float, bool, bytes, type(None), np.generic)


def _describe(ops: TensorOps, value: Any, with_value: bool) -> str:
    if isinstance(value, _PLAIN):
        return repr(value)
    host = isinstance(value, np.ndarray)
    arr = np.ascontiguousarray(value if host else np.asarray(ops.to_numpy(value)))
    head = f"{arr.dtype if host else ops.dtype_name(value)}{list(arr.shape)}"
    if not with_value:
        return head
    return f"{head} #{hashlib.blake2b(arr.view(np.uint8).reshape(-1).data, digest_size=16).hexdigest()}"


def fingerprint(ops: TensorOps, state: Any, prefix: str, with_values: bool = True,
                out: dict[str, str] | None = None) -> dict[str, str]:
    """``state`` (nested dicts / lists of tensors and plain values) as ``{path: entry}`` (module
    docstring); ``with_values`` False describes structure only (per-rank state). Added to ``out``."""
    out = {} if out is None else out
    if isinstance(state, Mapping):
        if not state:
            out[prefix] = "{}"
        for k, v in state.items():
            fingerprint(ops, v, f"{prefix}.{k}", with_values, out)
    elif isinstance(state, (list, tuple)) and not all(isinstance(v, _PLAIN) for v in state):
        for i, v in enumerate(state):
            fingerprint(ops, v, f"{prefix}[{i}]", with_values, out)
    elif isinstance(state, (list, tuple)):
        out[prefix] = repr(list(state))
    else:
        out[prefix] = _describe(ops, state, with_values)
    return out


def _digest(entries: Mapping[str, str]) -> str:
    h = hashlib.sha256()
    for k in sorted(entries):
        h.update(f"{k}={entries[k]};".encode())
    return h.hexdigest()


def verify_same_state(comm: Communicator, entries: Mapping[str, str], what: str, fix: str,
                      name: str = "verify.state.digest") -> None:
    """Refuse, on every rank, a state whose fingerprint differs across ranks.

    One allgather of a digest (a collective: every rank calls it at the same point); on a
    mismatch the maps are exchanged and the error names the first differing entry (sorted by
    path), its description on each rank, and ``fix``.

    Raises:
        RankMismatchError: the state differs.
    """
    if comm.size == 1:
        return
    if len(set(comm.allgather_object(_digest(entries), name=name))) == 1:
        return
    everyone = comm.allgather_object(dict(entries), name=name.replace("digest", "entries"))
    paths = sorted({p for d in everyone for p in d})
    differ = [p for p in paths if len({d.get(p) for d in everyone}) > 1]
    path = differ[0]
    groups: dict[str, list[int]] = {}
    for r, d in enumerate(everyone):
        groups.setdefault(d.get(path, "absent"), []).append(r)
    per_rank = "; ".join(f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}: {entry}"
                         for entry, rs in groups.items())
    more = f" ({len(differ) - 1} more entr{'y differs' if len(differ) == 2 else 'ies differ'})" if len(differ) > 1 else ""
    raise RankMismatchError(f"{what} differs across ranks: '{path}' is {per_rank}{more}. {fix}")


def missing_compression_state(engine_state: Mapping | None, expects_memory: bool) -> str | None:
    """Why a loaded checkpoint cannot restore the compressor's memory the optimizer keeps (None if
    it can, or if the optimizer keeps none): no ``"hvd_commopt"`` section at all, or a section
    without a memory (saved by an uncompressed run or a compressor without memory)."""
    if not expects_memory:
        return None
    if engine_state is None:
        return ("it has no 'hvd_commopt' section (saved from an optimizer that was not a DistributedOptimizer, "
                "or without its state_dict())")
    parts = list(engine_state.get("ranks", {}).values()) if "format" in engine_state else [engine_state]
    if parts and all(not (p.get("reducer") or {}).get("memory") for p in parts):
        return "its compression section holds no memory (saved by an uncompressed run, or a compressor without one)"
    return None


def _bucket_entries(tree: Any, path: str) -> Iterable[tuple[str, str, Any]]:
    """(path, key, value) of every non-dict leaf in ``tree``."""
    if isinstance(tree, Mapping):
        for k, v in tree.items():
            if isinstance(v, Mapping):
                yield from _bucket_entries(v, f"{path}.{k}")
            else:
                yield path, str(k), v


_FULL_SIZE = (".residuals", ".momentums", ".velocities")  # the memories that hold one value per bucket element


def check_memory_shapes(ops: TensorOps, memory: Mapping, bucket_sizes: Mapping[str, int]) -> None:
    """Refuse, at load time, a memory tensor (residual, DGC's ``u``/``v``) whose size is not its
    bucket's: it would fail (or be silently broadcast) at the first step.

    Raises:
        ConfigError: naming the bucket, both sizes and the fix.
    """
    for path, key, value in _bucket_entries(memory, "memory"):
        if not path.endswith(_FULL_SIZE) or key not in bucket_sizes or isinstance(value, _PLAIN):
            continue
        size = int(value.size if isinstance(value, np.ndarray) else ops.numel(value))
        if size != bucket_sizes[key]:
            raise ConfigError(
                f"the checkpoint's {path} for bucket '{key}' holds {size} values, but this optimizer's bucket "
                f"'{key}' has {bucket_sizes[key]}: the checkpoint was saved with another model, fusion_threshold "
                f"or fusion plan. Resume with the settings that saved it, or load the model and optimizer state "
                f"without the 'hvd_commopt' section (the compression memory then starts at zero)")
