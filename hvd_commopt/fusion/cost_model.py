"""Latency-bandwidth (alpha-beta) cost models of the collectives the planners schedule.

Two uses of the same :class:`AlphaBeta` pair, kept apart on purpose:

* **A fitted collective model** (docs/cost-models.md#fitted-allreduce-model, MG-WFBP ``profiling.py``): ``t(M) = alpha + beta*M``
  with ``M`` the message size in bytes and ``t(0) = 0``, fitted by least squares on measured
  times of *one whole collective* at a fixed rank count P. This is what the planners consume.
* **A link model** fed into the closed-form collective formulas of docs/cost-models.md#closed-form-costs / docs/gtopk.md#costs (the HKBU
  README table), where ``alpha`` is one point-to-point startup and ``beta`` the seconds per byte
  on one link. :meth:`CostModel.from_link` turns a link model into fitted-style collective
  models so both routes end in the same :class:`CostModel`.

Sizes are always **bytes** (the reference formulas of docs/cost-models.md#closed-form-costs count words of 4 bytes; ``value_bytes`` and
``index_bytes`` make that explicit). A message of 0 bytes costs 0 seconds everywhere: a bucket
that sends nothing sends no message (docs/cost-models.md#fitted-allreduce-model).
"""
from __future__ import annotations

import json

import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import numpy as np

__all__ = [
    "AlphaBeta",
    "CostModel",
    "CommTimeFn",
    "ring_allreduce_time",
    "allgather_time",
    "topk_allgather_time",
    "gtopk_time",
    "oktopk_time",
    "hist_bins",
    "sparse_k",
]

CommTimeFn = Callable[[int], float]
"""Seconds to communicate one bucket of the given number of (uncompressed) bytes."""

_ALLGATHER_ALGOS = ("ring", "recursive_doubling")
_GTOPK_ALGOS = ("recursive_doubling", "tree")


def _check_ranks(ranks: int) -> None:
    if int(ranks) != ranks or ranks < 1:
        raise ValueError(f"number of ranks must be an integer >= 1, got {ranks!r}")


def _check_nbytes(nbytes: float, what: str = "nbytes") -> None:
    if not (nbytes >= 0):  # also rejects NaN
        raise ValueError(f"{what} must be >= 0, got {nbytes!r}; pass a message size in bytes")


@dataclass(frozen=True)
class AlphaBeta:
    """``t(nbytes) = alpha + beta * nbytes`` for ``nbytes > 0`` and ``t(0) = 0`` (docs/cost-models.md#fitted-allreduce-model).

    Attributes:
        alpha: seconds per message (startup latency), >= 0.
        beta: seconds per byte, >= 0.
    """

    alpha: float
    beta: float

    def __post_init__(self) -> None:
        for name in ("alpha", "beta"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"AlphaBeta.{name} must be finite and >= 0, got {v!r}; "
                                 f"use AlphaBeta.fit() to obtain a non-negative model from timings")
        object.__setattr__(self, "alpha", float(self.alpha))
        object.__setattr__(self, "beta", float(self.beta))

    def time(self, nbytes: float) -> float:
        """Seconds for one message of ``nbytes`` bytes (0 for an empty message)."""
        _check_nbytes(nbytes)
        return 0.0 if nbytes == 0 else self.alpha + self.beta * nbytes

    __call__ = time  # so an AlphaBeta is itself a CommTimeFn

    @classmethod
    def fit(cls, sizes_bytes: Sequence[float], times: Sequence[float]) -> AlphaBeta:
        """Least-squares fit of ``times ≈ alpha + beta * sizes`` with ``alpha, beta >= 0``.

        The unconstrained solution is computed in centred form (better conditioned than the normal
        equations when sizes are ~1e6 and beta ~1e-9). Noise on a fast network can make it
        negative: a negative ``alpha`` would make a message cheaper than nothing and break the
        planners' "saved startup" reasoning, so the fit is then re-solved under the constraint,
        which for this convex 2-variable problem means taking the better of the two boundary fits
        ``alpha = 0`` (``beta = Σ n·t / Σ n²``, a fit through the origin) and ``beta = 0``
        (``alpha = mean(t)``), each clipped at 0. Repeated sizes are fine (pass every sample, or
        one statistic per size).

        Raises:
            ValueError: fewer than two distinct sizes, mismatched lengths or non-finite values.
        """
        n = np.asarray(sizes_bytes, dtype=np.float64).reshape(-1)
        t = np.asarray(times, dtype=np.float64).reshape(-1)
        if n.shape != t.shape:
            raise ValueError(f"fit needs one time per size: got {n.size} sizes and {t.size} times")
        if not (np.all(np.isfinite(n)) and np.all(np.isfinite(t))):
            raise ValueError("fit got a non-finite size or time; drop failed measurements first")
        if np.unique(n).size < 2:
            raise ValueError("fit needs at least two distinct message sizes to separate alpha from beta")
        nm, tm = float(n.mean()), float(t.mean())
        dn = n - nm
        beta = float(dn @ (t - tm)) / float(dn @ dn)
        alpha = tm - beta * nm
        if alpha >= 0 and beta >= 0:
            return cls(alpha, beta)
        candidates = [(0.0, max(0.0, float(n @ t) / float(n @ n))), (max(0.0, tm), 0.0)]

        def sse(ab: tuple[float, float]) -> float:
            r = t - ab[0] - ab[1] * n
            return float(r @ r)

        return cls(*min(candidates, key=sse))

    def to_dict(self) -> dict[str, float]:
        return {"alpha": self.alpha, "beta": self.beta}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> AlphaBeta:
        try:
            return cls(float(d["alpha"]), float(d["beta"]))
        except KeyError as e:
            raise ValueError(f"AlphaBeta dict needs keys 'alpha' and 'beta'; missing {e}") from None


# -- closed-form collective costs over a link model (docs/cost-models.md#closed-form-costs, docs/gtopk.md#costs, docs/gtopk.md#non-power-of-two) ------------------------

def ring_allreduce_time(nbytes: float, ranks: int, link: AlphaBeta) -> float:
    """Ring allreduce: ``2α(P−1) + 2(P−1)/P · n · β`` (docs/cost-models.md#closed-form-costs, "Dense" row). 0 if n = 0 or P = 1."""
    _check_ranks(ranks)
    _check_nbytes(nbytes)
    p = ranks
    if nbytes == 0 or p == 1:
        return 0.0
    return 2 * link.alpha * (p - 1) + 2 * (p - 1) / p * nbytes * link.beta


def allgather_time(nbytes_per_rank: float, ranks: int, link: AlphaBeta,
                   algorithm: str = "ring") -> float:
    """Allgather of ``nbytes_per_rank`` from every rank; every rank receives (P−1)·n bytes.

    ``"ring"``: P−1 steps of one n-byte message, ``(P−1)(α + nβ)``. ``"recursive_doubling"``:
    ``⌈log2 P⌉ α + (P−1) n β``, the latency term the table in docs/cost-models.md#closed-form-costs uses for Top-k.
    """
    _check_ranks(ranks)
    _check_nbytes(nbytes_per_rank, "nbytes_per_rank")
    if algorithm not in _ALLGATHER_ALGOS:
        raise ValueError(f"allgather algorithm {algorithm!r} unknown; use one of {_ALLGATHER_ALGOS}")
    p = ranks
    if nbytes_per_rank == 0 or p == 1:
        return 0.0
    if algorithm == "ring":
        return (p - 1) * (link.alpha + nbytes_per_rank * link.beta)
    return math.ceil(math.log2(p)) * link.alpha + (p - 1) * nbytes_per_rank * link.beta


def topk_allgather_time(k: int, ranks: int, link: AlphaBeta, value_bytes: int = 4,
                        index_bytes: int = 4, algorithm: str = "ring", fused: bool = False) -> float:
    """Top-k exchange: every rank allgathers its k values and k indices (docs/cost-models.md#closed-form-costs, docs/topk.md#update-rule, docs/lags-omgs.md#collectives).

    ``fused=False`` counts two allgathers (values, then indices), as the reference code issues them
    (docs/lags-omgs.md#omgs-inputs). ``fused=True`` counts one allgather of ``k(vb+ib)`` bytes;
    with ``algorithm="recursive_doubling"`` and 4-byte words that is the README's
    ``α log P + 2(P−1) k β``.
    """
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    if fused:
        return allgather_time(k * (value_bytes + index_bytes), ranks, link, algorithm)
    return (allgather_time(k * value_bytes, ranks, link, algorithm)
            + allgather_time(k * index_bytes, ranks, link, algorithm))


def _gtopk_messages(ranks: int, k: int, value_bytes: int, index_bytes: int,
                    algorithm: str) -> list[int]:
    """Sizes (bytes) of the messages on the critical path of one gTop-k allreduce."""
    _check_ranks(ranks)
    if algorithm not in _GTOPK_ALGOS:
        raise ValueError(f"gTop-k algorithm {algorithm!r} unknown; use one of {_GTOPK_ALGOS}")
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    p = ranks
    if p == 1 or k == 0:
        return []
    pair = k * (value_bytes + index_bytes)  # one (I, V) list of k entries = "2k words"
    if algorithm == "tree":
        # docs/gtopk.md#tree-variant/docs/gtopk.md#costs: binomial reduce then binomial broadcast, ⌈log2 P⌉ rounds each.
        return [pair] * (2 * math.ceil(math.log2(p)))
    m = 1 << (p.bit_length() - 1)  # largest power of two <= P
    rounds = [pair] * (m.bit_length() - 1)  # log2(m) recursive-doubling rounds (docs/gtopk.md#recursive-doubling)
    if m == p:
        return rounds
    # docs/gtopk.md#non-power-of-two fold (rank m+j -> j) before, unfold (result + k-bit survival mask, j -> m+j) after.
    return [pair] + rounds + [pair + (k + 7) // 8]


def gtopk_time(k: int, ranks: int, link: AlphaBeta, value_bytes: int = 4, index_bytes: int = 4,
               algorithm: str = "recursive_doubling") -> float:
    """gTop-k sparse allreduce (docs/gtopk.md#costs, docs/gtopk.md#non-power-of-two).

    ``"recursive_doubling"``: ``log2 P · (α + 2kβ)`` for P = 2^m (README ``α log P + 2k log P β``);
    for other P, ``(⌊log2 P⌋ + 2)(α + 2kβ)`` plus ``⌈k/8⌉`` mask bytes (fold + unfold, docs/gtopk.md#non-power-of-two).
    Note ⌊log2 P⌋ doubling rounds, not ⌈log2 P⌉: the two extra rounds are the fold/unfold.
    ``"tree"``: reduce + broadcast, ``2⌈log2 P⌉ (α + 2kβ)`` (docs/gtopk.md#costs, docs/gtopk.md#tree-variant code).
    A "word" here is ``value_bytes + index_bytes`` per entry.
    """
    return sum(link.time(m) for m in _gtopk_messages(ranks, k, value_bytes, index_bytes, algorithm))


def hist_bins(k: int) -> int:
    """Bins of Ok-Topk's magnitude histogram (int32 counts over the keys' top bits): 1024 (the
    exponent and 2 mantissa bits) below k = 2048, else 4096, so it stays small beside 2k pairs."""
    return 1024 if k < 2048 else 4096


def oktopk_time(k: int, ranks: int, link: AlphaBeta, value_bytes: int = 4, index_bytes: int = 4) -> float:
    """Seconds of one Ok-Topk allreduce over a link model (docs/oktopk.md#traffic): P-1 pairwise
    rounds of about k/P pairs (split and reduce), ring allreduces of the magnitude histogram
    (:func:`hist_bins`) and of 256 sub-bins, and an allgatherv of about k/P pairs per rank."""
    p = ranks
    if p == 1 or k == 0:
        return 0.0
    part = k / p * (value_bytes + index_bytes)
    return ((p - 1) * link.time(part) + ring_allreduce_time(4 * hist_bins(k), p, link)
            + ring_allreduce_time(4 * 256, p, link)
            + allgather_time(part, p, link))


def sparse_k(nbytes: int, density: float, elem_bytes: int = 4) -> int:
    """Entries a Top-k compressor keeps for a bucket: ``max(int(n·ρ), 1)`` (docs/wrapper.md#k-per-bucket), 0 if empty."""
    if not (0 < density <= 1):
        raise ValueError(f"density must be in (0, 1], got {density!r}")
    if elem_bytes <= 0:
        raise ValueError(f"elem_bytes must be > 0, got {elem_bytes}")
    _check_nbytes(nbytes)
    n = int(nbytes) // elem_bytes
    return 0 if n == 0 else max(int(n * density), 1)


# -- the model the planners and the simulator consume ---------------------------------------------

@dataclass(frozen=True)
class CostModel:
    """Per-collective fitted models at a fixed number of ranks.

    Attributes:
        allreduce: time of one allreduce as a function of the buffer's bytes.
        allgather: time of one allgather as a function of the bytes *each rank contributes*
            (the docs/lags-omgs.md#omgs-inputs by the gathered total ``ρx·P·4``; its ``b_P``
            is our ``beta / P``).
        p2p: time of one pairwise exchange (send n bytes while receiving n bytes), used for
            gTop-k's rounds. ``None`` if not measured (P = 1, or calibrated without it).
        ranks: P, the number of ranks the fits hold for.
    """

    allreduce: AlphaBeta
    allgather: AlphaBeta
    p2p: AlphaBeta | None = None
    ranks: int = 1

    def __post_init__(self) -> None:
        _check_ranks(self.ranks)

    @classmethod
    def from_link(cls, link: AlphaBeta, ranks: int, allgather_algorithm: str = "ring") -> CostModel:
        """Collective models implied by a link model and the docs/cost-models.md#closed-form-costs formulas.

        ``allreduce = (2α(P−1), 2(P−1)/P·β)`` (ring). ``allgather`` is ring ``((P−1)α, (P−1)β)``
        or recursive doubling ``(⌈log2 P⌉α, (P−1)β)``. ``p2p = link``.
        """
        _check_ranks(ranks)
        p = ranks
        if allgather_algorithm not in _ALLGATHER_ALGOS:
            raise ValueError(f"allgather algorithm {allgather_algorithm!r} unknown; use one of {_ALLGATHER_ALGOS}")
        ar = AlphaBeta(2 * link.alpha * (p - 1), 2 * (p - 1) / p * link.beta)
        ag_alpha = (p - 1) * link.alpha if allgather_algorithm == "ring" else math.ceil(math.log2(p)) * link.alpha
        ag = AlphaBeta(ag_alpha, (p - 1) * link.beta)
        return cls(allreduce=ar, allgather=ag, p2p=link, ranks=p)

    def allreduce_time(self, nbytes: float) -> float:
        return self.allreduce.time(nbytes)

    def allgather_time(self, nbytes_per_rank: float) -> float:
        return self.allgather.time(nbytes_per_rank)

    def topk_time(self, nbytes: int, density: float, elem_bytes: int = 4, value_bytes: int = 4,
                  index_bytes: int = 4, min_k: int = 1) -> float:
        """Top-k of a dense bucket of ``nbytes``, exchanged as our runtime sends it: ONE allgather of
        each rank's k values and k indices packed as one message (docs/topk.md#one-message). The
        reference code's two allgathers are :func:`topk_allgather_time` with ``fused=False``.
        ``k = max(sparse_k, min_k)``, at most the bucket's elements (a selector's ``min_k``)."""
        if self.ranks == 1:
            return 0.0
        k = min(max(sparse_k(nbytes, density, elem_bytes), min_k), int(nbytes) // elem_bytes)
        return self.allgather.time(k * (value_bytes + index_bytes))

    def gtopk_time(self, nbytes: int, density: float, elem_bytes: int = 4, value_bytes: int = 4,
                   index_bytes: int = 4) -> float:
        """gTop-k recursive doubling (with the docs/gtopk.md#non-power-of-two fold/unfold) priced with the ``p2p`` fit."""
        k = sparse_k(nbytes, density, elem_bytes)
        msgs = _gtopk_messages(self.ranks, k, value_bytes, index_bytes, "recursive_doubling")
        if not msgs:
            return 0.0
        if self.p2p is None:
            raise ValueError("gTop-k cost needs a point-to-point fit: calibrate with p2p enabled, or "
                             "build the model with CostModel.from_link(link, ranks)")
        p2p = self.p2p
        return float(sum(p2p.time(m) for m in msgs))

    def comm_time_fn(self, compression: str = "none", density: float = 1.0, elem_bytes: int = 4,
                     value_bytes: int = 4, index_bytes: int = 4) -> CommTimeFn:
        """Per-bucket communication time (bucket bytes -> seconds) for a compression method.

        Args:
            compression: ``"none"`` (dense allreduce), ``"fp16"`` (allreduce of half the bytes;
                ``elem_bytes`` is then the uncompressed element size), ``"topk"`` (one packed
                allgather, docs/topk.md#one-message) or ``"gtopk"`` (docs/gtopk.md#gtopk).
            density: fraction kept by the sparse methods.
        """
        if compression == "none":
            return self.allreduce.time
        if compression == "fp16":
            if elem_bytes != 4:
                raise ValueError("fp16 compression prices float32 buckets; pass elem_bytes=4")
            return lambda nbytes: self.allreduce.time(nbytes // 2)
        if compression == "topk":
            sparse_k(0, density, elem_bytes)  # validate now, not at first call
            return lambda nbytes: self.topk_time(nbytes, density, elem_bytes, value_bytes, index_bytes)
        if compression == "gtopk":
            sparse_k(0, density, elem_bytes)
            return lambda nbytes: self.gtopk_time(nbytes, density, elem_bytes, value_bytes, index_bytes)
        if compression == "oktopk":  # docs/oktopk.md#traffic: pairwise rounds on the p2p fit if any
            sparse_k(0, density, elem_bytes)
            link = self.p2p if self.p2p is not None else self.allgather
            return lambda nbytes: oktopk_time(sparse_k(nbytes, density, elem_bytes), self.ranks, link,
                                              value_bytes, index_bytes)
        raise ValueError(f"compression {compression!r} unknown; use 'none', 'fp16', 'topk', 'gtopk' or 'oktopk'")

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable form (``json.dumps`` works on it directly)."""
        return {"ranks": self.ranks, "allreduce": self.allreduce.to_dict(),
                "allgather": self.allgather.to_dict(),
                "p2p": None if self.p2p is None else self.p2p.to_dict()}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> CostModel:
        try:
            p2p = d.get("p2p")
            return cls(allreduce=AlphaBeta.from_dict(d["allreduce"]),
                       allgather=AlphaBeta.from_dict(d["allgather"]),
                       p2p=None if p2p is None else AlphaBeta.from_dict(p2p),
                       ranks=int(d.get("ranks", 1)))
        except KeyError as e:
            raise ValueError(f"CostModel dict needs 'allreduce' and 'allgather' entries; missing {e} "
                             f"(write it with CostModel.to_dict or python -m hvd_commopt.calibrate)") from None

    @classmethod
    def load(cls, spec: Any) -> CostModel:
        """``spec`` as a CostModel: one already, its :meth:`to_dict`, or the path of that dict as
        JSON (what ``python -m hvd_commopt.calibrate`` writes)."""
        if isinstance(spec, CostModel):
            return spec
        if isinstance(spec, str):
            with open(spec) as f:
                spec = json.load(f)
        return cls.from_dict(spec)
