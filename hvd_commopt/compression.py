"""``Compression``: the user-facing namespace of compression choices (Horovod's names kept).

``Compression.none`` and ``Compression.fp16`` are values, as in Horovod, so
``compression=hvd.Compression.fp16`` keeps working after changing the import. The sparse
methods are factories: each call returns a new *stateful* reducer (error-feedback residuals,
step counters), to be given to one optimizer::

    opt = hco.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                   compression=hco.Compression.gtopk(density=0.001))

Whole-model versus layer-wise selection is decided by the fusion buckets: one bucket
(``fusion_threshold`` at least the model's gradient size) selects the top-k of the whole
gradient (the default 25 MiB cap gives one bucket for models up to ~6.5M fp32 parameters); one
bucket per layer (``fusion_threshold=0``) is LAGS-SGD, each layer sparsified and sent from the
backward hooks while backward continues. ``Compression.topk(density, layerwise=True)`` selects
LAGS's per-layer top-k inside fused buckets, one exchange per bucket. ``density`` may be a dict or callable for per-layer
densities (see :class:`hvd_commopt.compress.selector.DensitySpec`).
"""
from __future__ import annotations

from typing import Any, Sequence, TypeVar

from .errors import ConfigError
from .autocompress.options import AutoOptions
from .autocompress.reducer import AutoReducer
from .compress.cast import BF16Compressor, FP16Compressor, NoneCompressor
from .compress.dgc import DGCSelector
from .compress.quantize import DEFAULT_BLOCK
from .compress.randomk import RandomKSelector
from .compress.selector import Density
from .compress.topk import TopKSelector
from .compress.warmup import DensityWarmup
from .memory.dgc import DGCMemory
from .memory.error_feedback import ErrorFeedback
from .memory.momentum import MomentumCorrection
from .reduce.gtopk import GTopK
from .reduce.oktopk import OkTopK
from .reduce.quantized import QuantizedAllreduce
from .reduce.sparse import SparseReducer
from .reduce.sparse_allgather import SparseAllgather

__all__ = ["Compression"]


def _memory(error_feedback: bool, momentum_correction: bool | None, momentum_masking: bool,
            nonfinite: str = "skip"):
    """Error feedback, or DGC's momentum correction with the wrapped optimizer's momentum
    (docs/topk.md#momentum-correction): the one place every sparse reducer gets it from."""
    auto = momentum_correction is None
    if auto:
        momentum_correction = bool(error_feedback)
    if not momentum_correction:
        return ErrorFeedback(error_feedback, nonfinite)
    if not error_feedback:
        raise ConfigError("momentum_correction keeps the unsent velocity, which is error feedback: pass "
                          "error_feedback=True, or momentum_correction=False")
    return MomentumCorrection(momentum_masking=momentum_masking, auto=auto, nonfinite=nonfinite)


_R = TypeVar("_R", bound=SparseReducer)


def _warm(reducer: _R, warmup_steps: int | None) -> _R:
    """The factories' ``warmup_steps=`` on the reducer's selector (docs/adaptive-optimizers.md#warmup-steps)."""
    warmup = DensityWarmup.from_steps(warmup_steps)
    if warmup is not None:
        reducer.compressor.warmup = warmup
    return reducer


class Compression:
    """Compression choices for ``DistributedOptimizer(compression=...)``."""

    none = NoneCompressor()
    fp16 = FP16Compressor()
    bf16 = BF16Compressor()

    @staticmethod
    def topk(density: Density = 0.001, error_feedback: bool = True, index_dtype: str | None = None,
             momentum_correction: bool | None = None, momentum_masking: bool = False, min_k: int = 16,
             nonfinite: str = "skip", selection: str = "exact", tau: int = 16, band: float = 0.2,
             dense_1d: bool = True, layerwise: bool = False, warmup_steps: int | None = None) -> SparseAllgather:
        """Top-k S-SGD (docs/topk.md#update-rule): exact top-k per bucket, allgather of (values, indices).

        Args:
            density: fraction in (0, 1] of each bucket sent; a dict {layer: density} or a
                callable (bucket_name, numel) -> density for per-layer (LAGS) densities.
            error_feedback: keep what was not sent in a residual added to the next gradient.
            index_dtype: "int32" / "int64" / None (int32 when possible).
            momentum_correction: accumulate the wrapped optimizer's momentum locally before
                selection, as DGC does (docs/topk.md#momentum-correction); the optimizer then runs
                without momentum. None (default) = on with error feedback.
            momentum_masking: with correction, zero the momentum where values were sent (DGC's
                factor masking). Off by default for Top-k (and LAGS): it cost Top-k points on every
                task measured, on none gained more than seed noise (docs/convergence-matrix.md#masking);
                gTop-k, Ok-Topk, random-k and DGC keep it on.
            min_k: the fewest elements any bucket sends (docs/topk.md#density-floor), 16 by
                default (the reference rule is 1): with one bucket per layer (LAGS) it keeps small
                layers from starving (docs/lags-omgs.md#lags-starvation).
            nonfinite: "skip" or "raise", for a NaN/Inf gradient (docs/wrapper.md#nonfinite; every
                constructor below takes it too).
            selection: "exact" (bit-identical to the reference top-k), "threshold" (Ok-Topk's
                threshold reuse: exact every ``tau`` steps, the count kept within
                ``k·(1 ± band)``; drift in ``reducer.stats()``) or "sampled" (DGC's sampled
                threshold); docs/selection.md.
            dense_1d: send 1-D tensors (biases, normalisation scales and shifts) whole, in buckets
                of their own, as DGC's and PowerSGD's reference code do; False selects them with
                the matrices (docs/topk.md#dense-1d; every sparse constructor below takes it).
            layerwise: the top-k of each tensor, as LAGS-SGD selects, inside fused buckets sent
                whole (docs/lags-omgs.md#lags-merged); a dict or callable density is then asked by
                tensor name. Exact selection only.
            warmup_steps: send every bucket whole for this many optimizer steps first
                (docs/adaptive-optimizers.md#warmup-steps; every sparse constructor below takes it).
                None (default): none under SGD, 100 steps under Adam and kin; 0: none at all.
        """
        return _warm(SparseAllgather(TopKSelector(density, selection, tau, band, min_k=min_k, dense_1d=dense_1d,
                                                  layerwise=layerwise),
                                     _memory(error_feedback, momentum_correction, momentum_masking, nonfinite),
                                     index_dtype), warmup_steps)

    @staticmethod
    def randomk(density: Density = 0.001, seed: int = 0, error_feedback: bool = True,
                momentum_correction: bool | None = None, momentum_masking: bool = True, min_k: int = 16,
                unbiased: bool = False, nonfinite: str = "skip", dense_1d: bool = True,
                warmup_steps: int | None = None) -> SparseAllgather:
        """Random-k with a seed shared by all ranks: the same k indices everywhere, so the k
        values are allreduced (no indices sent). ``seed`` must be equal on every rank.

        ``momentum_correction`` (default: on with error feedback) as :meth:`topk`'s: without it,
        error feedback and the optimizer's momentum diverge (docs/topk.md#randomk-momentum).
        ``unbiased=True`` scales the sent values by n/k, without error feedback.
        """
        if unbiased and error_feedback:
            raise ConfigError("unbiased random-k scales the sent values by n/k, an estimate of the whole "
                              "gradient; error feedback would send the rest again later. Pass "
                              "error_feedback=False with unbiased=True")
        return _warm(SparseAllgather(RandomKSelector(density, seed, min_k, unbiased, dense_1d),
                                     _memory(error_feedback, momentum_correction, momentum_masking, nonfinite)),
                     warmup_steps)

    @staticmethod
    def dgc(density: Density = 0.001, momentum: float | None = None, nesterov: bool = False,
            momentum_masking: bool = True, clip_norm: float | None = None, sample_ratio: float = 0.01,
            warmup_epochs: int = 0, warmup_coeff: float | Sequence[float] | None = None,
            steps_per_epoch: int | None = None, seed: int = 0,
            index_dtype: str | None = None, nonfinite: str = "skip", selection: str = "sampled", tau: int = 16,
            band: float = 0.2, dense_1d: bool = True, warmup_steps: int | None = None) -> SparseAllgather:
        """Deep Gradient Compression (docs/dgc.md#update-rule): sampled threshold, momentum correction and
        factor masking, optional local clipping, sparsity warm-up.

        DGC applies the momentum itself: ``momentum=None`` (default) takes the wrapped optimizer's
        momentum (and Nesterov flag) and runs that optimizer without it; an explicit ``momentum``
        needs an optimizer without momentum (docs/dgc.md#optimizer-momentum). For the warm-up
        give ``steps_per_epoch`` or call ``set_epoch(e)`` on the returned reducer each epoch;
        ``warmup_coeff=None`` is the reference code's schedule (not the README's, see
        :mod:`hvd_commopt.compress.dgc`). ``selection`` "sampled" is DGC's threshold; "exact" or
        "threshold" select k = ceil(n·ratio) as :meth:`topk` does (docs/selection.md). ``warmup_steps``
        (dense steps, as :meth:`topk`'s) and ``warmup_epochs`` (DGC's exponential schedule) exclude
        each other.
        """
        if warmup_steps is not None and warmup_epochs:
            raise ConfigError(f"pass one warm-up: warmup_steps={warmup_steps} (every bucket sent whole for that "
                              f"many steps) or warmup_epochs={warmup_epochs} (DGC's exponential schedule per epoch)")
        comp = DGCSelector(density, sample_ratio=sample_ratio, warmup_epochs=warmup_epochs,
                             warmup_coeff=warmup_coeff, steps_per_epoch=steps_per_epoch, seed=seed,
                             selection=selection, tau=tau, band=band, dense_1d=dense_1d)
        mem = DGCMemory(momentum=momentum, nesterov=nesterov, momentum_masking=momentum_masking,
                        clip_norm=clip_norm, nonfinite=nonfinite)
        return _warm(SparseAllgather(comp, mem, index_dtype), warmup_steps)

    @staticmethod
    def gtopk(density: Density = 0.001, error_feedback: bool = True, index_dtype: str | None = None,
              algorithm: str = "recursive_doubling", momentum_correction: bool | None = None,
              momentum_masking: bool = True, min_k: int = 16, nonfinite: str = "skip", dense_1d: bool = True,
              warmup_steps: int | None = None) -> GTopK:
        """gTop-k S-SGD (docs/gtopk.md#gtopk): global top-k by recursive doubling, O(k log P) traffic, for
        any number of ranks; dropped local values return to the residual (the velocity, with
        momentum correction). ``momentum_correction``, ``momentum_masking``, ``min_k`` and
        ``warmup_steps`` as :meth:`topk`'s."""
        return _warm(GTopK(density, error_feedback=error_feedback, index_dtype=index_dtype, algorithm=algorithm,
                           memory=_memory(error_feedback, momentum_correction, momentum_masking, nonfinite),
                           min_k=min_k, dense_1d=dense_1d), warmup_steps)

    @staticmethod
    def oktopk(density: Density = 0.001, error_feedback: bool = True, index_dtype: str | None = None,
               selection: str = "exact", tau: int = 16, band: float = 0.2, rebalance: int = 16,
               momentum_correction: bool | None = None, momentum_masking: bool = True, min_k: int = 16,
               nonfinite: str = "skip", dense_1d: bool = True, warmup_steps: int | None = None) -> OkTopK:
        """Ok-Topk (docs/oktopk.md#oktopk): O(k) sparse allreduce, split-and-reduce over P load-balanced
        regions, the exact global top-k, a balanced allgatherv; every rank gets the same k
        entries, dropped local values return to the residual (the velocity, with momentum
        correction). ``rebalance``: steps between recomputations of the region cuts;
        ``selection``/``tau``/``band``: the local selection; the rest as :meth:`topk`'s."""
        return _warm(OkTopK(density, error_feedback=error_feedback, index_dtype=index_dtype, selection=selection,
                            tau=tau, band=band, rebalance=rebalance, min_k=min_k, dense_1d=dense_1d,
                            memory=_memory(error_feedback, momentum_correction, momentum_masking, nonfinite)),
                     warmup_steps)

    @staticmethod
    def auto(min_density: float | None = None, allow: Sequence[str] | None = None, margin: float = 0.25,
             period: int = 200, verbose: bool = False, cost_model: Any = None) -> AutoReducer:
        """Per bucket, the method with the shortest predicted step (docs/auto-compression.md#model):
        dense fp32, bf16/fp16, or Top-k / DGC / gTop-k / Ok-Topk / random-k at a density, all
        with error feedback, from the calibrated link, the measured selection cost and the
        profiled backward timeline; rank 0 decides, every rank follows. ``compression="auto"`` is
        ``Compression.auto()``.

        Args:
            min_density: the lowest density a sparse method may use; by default the rule of the
                optimizer and model kinds (docs/auto-compression.md#kinds): 0.1 in every cell (no sparse
                method is a default; they never run under Adam).
            allow: the methods to choose from, of ``"none"``, ``"bf16"``, ``"fp16"``, ``"quant8"``,
                ``"quant4"``, ``"quant2"`` (the quantisers with error feedback, docs/auto-compression.md#quantised),
                ``"topk"``, ``"dgc"``, ``"dgc_masked"`` (DGC with momentum factor masking,
                docs/auto-compression.md#dgc-masked), ``"gtopk"``, ``"oktopk"``, ``"randomk"``. By
                default the methods within the accuracy target on every convergence task of the
                wrapped optimizer's and the model's kind (:data:`~hvd_commopt.autocompress.kinds.RULES`,
                docs/auto-compression.md#kinds): dense fp32, bf16, int8; plus int4 for a model that
                is not convolutional, under SGD or Adam. Above 2 ranks the cells are those the
                4-rank runs back (:data:`~hvd_commopt.autocompress.kinds.RULES_MANY`,
                docs/auto-compression.md#kinds-ranks). Dense fp32 is always a candidate.
            margin: re-decide when the measured step and the prediction differ by more than this
                fraction (checked every ``period`` steps).
            period: at least this many steps between two decisions.
            verbose: print the report on rank 0 after each decision.
            cost_model: a fitted link model (``CostModel``, its dict or a JSON path) instead of
                calibrating the link (e.g. an emulated link measured once).

        Raises:
            ConfigError: ``allow`` naming an unknown method or nothing, or a bound that excludes
                every method allowed.
        """
        allowed = None if allow is None else (allow,) if isinstance(allow, str) else tuple(allow)
        return AutoReducer(AutoOptions(min_density=min_density, allow=allowed, margin=margin, period=period, verbose=verbose,
                                       cost_model=cost_model))

    @staticmethod
    def quantize(bits: int, density: float | None = None, block: int = DEFAULT_BLOCK, error_feedback: bool = True,
                 nonfinite: str = "skip", chunk: int | None = None, ef_decay: float = 1.0,
                 mean_over: str = "ranks") -> QuantizedAllreduce:
        """Low-bit quantisation with a float32 scale per ``block`` elements and error feedback
        (docs/quantize.md#exchange): ``bits`` 8 (int8), 2-4 (int4 ... ternary), exchanged as a
        quantised reduce-scatter then all-gather, so the error is at most two quantisations.
        ``density=rho`` sends the quantised top-k instead (all-gathered indices and codes):
        SparseLoCo's recipe is ``Compression.quantize(2, density=0.01)`` (docs/quantize.md#sparseloco).
        Composes with every schedule: gradients under S-SGD and OD/SSD, pseudo-gradients under
        local SGD, CoCoD and DiLoCo. ``chunk=4096`` takes the top-k per chunk of each tensor and
        ``ef_decay=0.95`` decays the error feedback, as SparseLoCo does (docs/quantize.md#chunked).
        ``mean_over="senders"`` averages each value over the ranks that sent it, as SparseLoCo's code
        does (docs/quantize.md#mean-over-senders)."""
        return QuantizedAllreduce(bits, density=density, block=block, error_feedback=error_feedback,
                                  nonfinite=nonfinite, chunk=chunk, ef_decay=ef_decay,
                                  mean_over=mean_over)
