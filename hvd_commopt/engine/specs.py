"""The cross-rank checks at wrap time: every rank registered the same tensors, and every rank
runs them with the same settings (bucket plan, reducer, schedule, ...): docs/cross-rank-check.md#cross-rank-check."""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from ..buckets import TensorSpec
from ..comm.communicator import Communicator
from ..errors import ConfigError, RankMismatchError

__all__ = ["TensorSpec", "Setting", "verify_same_tensors", "verify_same_settings"]


def _digest(specs: Sequence[TensorSpec]) -> str:
    h = hashlib.sha256()
    for s in specs:
        h.update(f"{s.name}|{s.shape}|{s.dtype};".encode())
    return h.hexdigest()


def verify_same_tensors(comm: Communicator, specs: Sequence[TensorSpec], what: str = "model") -> None:
    """Refuse to start unless every rank registered the same tensors (names, shapes, dtypes).

    Compares a 32-byte digest across ranks; only on a mismatch are the full lists exchanged, so
    the error can name the first differing tensor. Every rank raises the same error (nobody is
    left waiting in a collective).

    Raises:
        RankMismatchError: naming the first differing tensor and the ranks concerned.
    """
    names = [s.name for s in specs]
    dups = sorted({n for n in names if names.count(n) > 1})
    if dups:
        raise ConfigError(f"tensor names must be unique; duplicates: {dups}. Pass "
                          f"named_parameters=model.named_parameters().")
    if comm.size == 1:
        return
    digests = comm.allgather_object(_digest(specs), name="verify.digest")
    if len(set(digests)) == 1:
        return
    lists = comm.allgather_object([(s.name, tuple(s.shape), s.dtype) for s in specs], name="verify.specs")
    ref = lists[0]
    for r, other in enumerate(lists[1:], start=1):
        if other == ref:
            continue
        for i in range(max(len(ref), len(other))):
            a = ref[i] if i < len(ref) else None
            b = other[i] if i < len(other) else None
            if a != b:
                def fmt(t):
                    return "nothing" if t is None else f"'{t[0]}' shape {tuple(t[1])} {t[2]}"
                raise RankMismatchError(
                    f"the {what} differs across ranks: tensor #{i} is {fmt(a)} on rank 0 but {fmt(b)} "
                    f"on rank {r} (rank 0 has {len(ref)} tensors, rank {r} has {len(other)}). Build the "
                    f"same model on every rank (same code, same arguments) before wrapping the optimizer.")


@dataclass(frozen=True)
class Setting:
    """One setting that must be equal on every rank.

    Attributes:
        value: plain data (numbers, strings, lists, dicts); only it is compared.
        hint: how to make it equal (shown once when it differs).
        note: where this rank's value came from (e.g. the environment variable), shown per rank.
    """

    value: Any
    hint: str = ""
    note: str | None = None


def _canon(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=repr)


def _show(value: Any, limit: int = 160) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _diff(path: str, values: list[Any]) -> list[tuple[str, list[Any]]]:
    """The differing leaves of per-rank ``values``: dicts with the same keys are compared key by
    key, anything else as a whole."""
    if all(isinstance(v, dict) for v in values) and len({tuple(sorted(map(str, v))) for v in values}) == 1:
        out = []
        for key in values[0]:
            sub = [v[key] for v in values]
            if len({_canon(x) for x in sub}) > 1:
                out.extend(_diff(f"{path}.{key}", sub))
        return out
    return [(path, values)]


def _per_rank(values: list[Any], notes: list[str | None]) -> str:
    groups: dict[tuple[str, str | None], list[int]] = {}
    for r, (v, n) in enumerate(zip(values, notes)):
        groups.setdefault((_show(v), n), []).append(r)
    parts = []
    for (shown, note), ranks in groups.items():
        who = f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))
        parts.append(f"{who}: {shown}" + (f" ({note})" if note else ""))
    return "; ".join(parts)


def verify_same_settings(comm: Communicator, settings: Mapping[str, Setting], what: str = "DistributedOptimizer",
                         derived: Sequence[str] = ()) -> None:
    """Refuse to start unless every rank has the same ``settings`` (compared by value).

    One digest is allgathered; only on a mismatch are the settings exchanged, so that every rank
    raises the same error naming each differing setting and its value on each rank. Settings in
    ``derived`` (e.g. the bucket plan, which follows from the others) are reported only when
    nothing else differs.

    Raises:
        RankMismatchError: naming the settings that differ, each rank's value and the fix.
    """
    if comm.size == 1:
        return
    digest = hashlib.sha256(_canon({k: s.value for k, s in settings.items()}).encode()).hexdigest()
    if len(set(comm.allgather_object(digest, name="verify.settings.digest"))) == 1:
        return
    mine = {k: (s.value, s.note, s.hint) for k, s in settings.items()}
    everyone = comm.allgather_object(mine, name="verify.settings")
    keys = list(dict.fromkeys(k for d in everyone for k in d))
    lines: list[str] = []
    later: list[str] = []
    for key in keys:
        vals = [d.get(key, (None, None, ""))[0] for d in everyone]
        if len({_canon(v) for v in vals}) == 1:
            continue
        notes = [d.get(key, (None, None, ""))[1] for d in everyone]
        hint = next((d[key][2] for d in everyone if key in d and d[key][2]), "")
        target = later if key in derived else lines
        for path, per_rank in _diff(key, vals):
            target.append(f"{path} differs across ranks: {_per_rank(per_rank, notes)}" + (f" ({hint})" if hint else ""))
    lines = lines or later
    head = "" if len(lines) == 1 else f"the {what} is configured differently across ranks:\n  "
    raise RankMismatchError(head + "\n  ".join(lines) + (
        "" if len(lines) == 1 else "\nUse the same code, arguments and environment on every rank."))
