"""Momentum correction meets the wrapped optimizer (docs/dgc.md#optimizer-momentum).

A memory that applies the momentum itself (a :class:`~hvd_commopt.memory.base.MomentumMemory`:
DGC's, Top-k/gTop-k/LAGS's ``momentum_correction``) applies it before selection, so the wrapped
optimizer must not apply it again. When the optimizer is attached, the reducers with a memory
(``SparseReducer.bind_host``, ``DenseAllreduce.bind_host``) give a memory built with
``momentum=None`` the optimizer's momentum, and return the host's hyper-parameter override that
runs the optimizer without it; the scheduler lays that override over every update. A sparse
reducer's selector is told the momentum that will be applied (``Selector.check_momentum``:
random-k's warning, docs/topk.md#randomk-momentum).
"""
from __future__ import annotations

from typing import Any

from ..compress.selector import Selector
from ..errors import ConfigError
from ..host import MomentumSwitch, ScheduleHost
from .adaptive import adapt_to_optimizer
from ..memory.base import Memory, MomentumMemory

__all__ = ["bind_momentum_memory"]


def bind_momentum_memory(memory: Memory, host: ScheduleHost, names: list[str], selector: Selector | None = None) -> Any:
    """Bind the wrapped optimizer's momentum to ``memory`` where it applies momentum; the host's
    override that switches the optimizer's momentum off, or None when there is nothing to switch
    off (no momentum correction, no optimizer, or an optimizer without momentum). ``selector``:
    the sparse reducer's, told the momentum that will be applied."""
    mem = memory if isinstance(memory, MomentumMemory) else None
    known = host.holds_weights  # a gradient-capturing host has no optimizer
    if known and names:  # Adam and kin: warm-up, no momentum correction (docs/adaptive-optimizers.md)
        adapt_to_optimizer(memory, selector, host)
    if selector is not None and known and names:  # e.g. random-k's warning (docs/topk.md#randomk-momentum)
        mu0 = float(host.param_hyper(names[0], "momentum", 0.0) or 0.0)
        selector.check_momentum(mem.momentum if mem is not None and not mem.from_optimizer else mu0, mem is not None)
    if mem is None or not names or not known:
        return None
    mus = {float(host.param_hyper(n, "momentum", 0.0) or 0.0) for n in names}
    nest = {bool(host.param_hyper(n, "nesterov", False)) for n in names}
    if len(mus) > 1 or len(nest) > 1:
        raise ConfigError(f"momentum correction needs one momentum for every parameter, but the wrapped "
                          f"optimizer's groups have momenta {sorted(mus)} (nesterov {sorted(nest)}); use one "
                          f"momentum, or pass momentum= to the compression and wrap an optimizer without momentum")
    mu, nesterov = mus.pop(), nest.pop()
    if mem.from_optimizer:
        mem.bind_momentum(mu, nesterov)
    elif mu and (mu != mem.momentum or nesterov != mem.nesterov):
        raise ConfigError(f"the compression applies momentum {mem.momentum} itself and the wrapped optimizer "
                          f"has momentum {mu}: that would apply momentum twice. Pass momentum=None to the "
                          f"compression (it then takes the optimizer's), or wrap an optimizer with momentum=0")
    if not mu:
        return None
    off = host.hyper_without_momentum() if isinstance(host, MomentumSwitch) else None
    if off is None and mem.auto:
        mem.bind_momentum(0.0)  # the optimizer keeps its momentum: plain error feedback (Keras)
        return None
    if off is None:
        raise ConfigError(f"the wrapped optimizer has momentum {mu}, which the compression applies itself "
                          f"(momentum correction), and this optimizer/adapter cannot run without it: wrap "
                          f"an optimizer with momentum=0 (e.g. keras.optimizers.SGD(lr)) and pass "
                          f"momentum={mu} to the compression")
    return off
