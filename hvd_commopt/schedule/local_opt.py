"""The local optimizer U_loc of OD-SGD / SSD-SGD / CD-SGD (docs/od-sgd.md#update-rule, docs/ssd-sgd.md#update-rule, docs/cd-sgd.md#update-rule).

    w_loc(t+1) = U_loc(b(t), s_loc * g_i(t))

b(t) is the base chosen by the scheduler (the global replica w_g(t) on base-switch steps, the
current local weights otherwise); g_i(t) is this worker's own gradient, evaluated at the current
local weights w_c = w_loc(t).

**SGD** (``local_optimizer="sgd"``), in PyTorch's form (docs/wrapper.md#momentum-form), with its own momentum buffer
that is never reset when the base jumps to the replica (the reference's behaviour, docs/od-sgd.md#pitfalls):

    d = s*g [+ c*g_glob (GLU, docs/ssd-sgd.md#glu-recommended-form)] + wd*b;   m = mu*m + (1-damp)*d (m = d at the first step)
    w = b - lr*m      (nesterov: w = b - lr*(d + mu*m))

The operations and their order are exactly ``torch.optim.SGD``'s single-tensor kernel
(``grad.add(param, alpha=wd)``, ``buf.mul_(mu).add_(d, alpha=1-dampening)``,
``param.add_(d, alpha=-lr)``), so with equal hyper-parameters and s = 1 the local and the global
update are bit-identical (T-OD-1). mu, dampening and nesterov are fixed per optimizer, or given
per call when the local optimizer mirrors the wrapped one (docs/od-sgd.md#local-defaults).

**DC-ASGD** (``local_optimizer="dcasgd"``), re-derived from its definition (Zheng et al., "Asynchronous
SGD with Delay Compensation", ICML 2017) rather than from the fork's kernel, whose ``lr/wd/lam``
arguments are swapped (docs/od-sgd.md#dcasgd-reference-bug). A gradient evaluated at w_c and applied at b is
compensated by the diagonal Hessian approximation lambda*g⊙g:

    g~ = g + lambda * g ⊙ g ⊙ (b - w_c)      (g = s*g_i)

Choice: w_c is the weights the gradient was *computed at* (the model's weights during
backward), as the definition says. The MXNet optimizer instead uses "the weights at its previous
call", i.e. the previous replica; that is the definition's w_c only when the local step is
undone by the next pull, which is not the case here. On SSD steps that do not switch the base,
b = w_c and the compensation is zero (there is no staleness to compensate).
"""
from __future__ import annotations

from typing import Any

__all__ = ["LocalOptimizer"]

Tensor = Any


class LocalOptimizer:
    """U_loc with its own state (momentum buffers keyed by tensor name).

    Args:
        ops: the adapter's TensorOps.
        kind: "sgd" or "dcasgd".
        momentum: mu (0 = no buffer); :meth:`update` may override it per tensor (mirroring).
        scale: s_loc, the factor on the worker's own gradient (1/P in the reference).
        dc_lambda: DC-ASGD's lambda.
    """

    def __init__(self, ops: Any, kind: str, momentum: float, scale: float, dc_lambda: float = 0.04):
        self.ops, self.kind = ops, kind
        self.momentum, self.scale, self.dc_lambda = float(momentum), float(scale), float(dc_lambda)
        self.buf: dict[str, Tensor] = {}
        self._d: dict[str, Tensor] = {}  # per-tensor scratch for the step direction d

    def update(self, name: str, w: Tensor, base: Tensor | None, grad: Tensor, *, lr: float,
               weight_decay: float = 0.0, glu_dir: Tensor | None = None, glu_coef: float = 0.0,
               momentum: float | None = None, dampening: float = 0.0, nesterov: bool = False) -> Tensor:
        """Return the new local weights (computed into ``w`` where the framework allows).

        Args:
            w: the current local weights (where ``grad`` was computed).
            base: b(t); None means "the current local weights" (no copy, no DC term).
            grad: the worker's own gradient g_i(t).
            lr, weight_decay: the local step size and weight decay for this tensor.
            glu_dir, glu_coef: SSD-SGD's global direction and its coefficient c.
            momentum, dampening, nesterov: this tensor's momentum settings (None = the
                optimizer's own ``momentum``, no dampening, no Nesterov).
        """
        ops = self.ops
        mu = self.momentum if momentum is None else float(momentum)
        dc = self.kind == "dcasgd" and self.dc_lambda and base is not None
        glu = glu_dir is not None and glu_coef
        if self.scale == 1.0 and not (dc or glu or weight_decay or (mu and nesterov)):
            # d = g is only read below (the mirroring default, docs/od-sgd.md#local-defaults,
            # without weight decay or Nesterov): no copy of the gradient at all
            d = grad
        else:
            # d in a buffer kept per tensor (written whole every step, never state): no new tensor
            # per tensor per step, and s*g in one pass instead of a clone and a scale
            d = self._d.get(name)
            if d is None:
                d = ops.scale(ops.clone(grad), self.scale) if self.scale != 1.0 else ops.clone(grad)
            elif self.scale != 1.0:
                d = ops.scale_into(d, grad, self.scale)
            else:
                d = ops.copy_(d, grad)
            self._d[name] = d
        if dc:
            # lambda * g ⊙ g ⊙ (b - w_c): computed before w is overwritten by the base.
            comp = ops.mul(ops.mul(d, d), ops.sub(ops.clone(base), w))
            d = ops.axpy_(d, self.dc_lambda, comp)
        if glu:
            d = ops.axpy_(d, glu_coef, glu_dir)
        b = w if base is None else base
        if weight_decay:
            d = ops.axpy_(d, weight_decay, b)
        if mu:
            m = self.buf.get(name)
            if m is None:
                m = ops.clone(d)  # torch: buf = clone(d_p) at the first step
            else:
                m = ops.axpy_(ops.scale(m, mu), 1.0 - dampening, d)
            self.buf[name] = m
            d = ops.axpy_(d, mu, m) if nesterov else m
        if base is not None:  # w = b - lr*d in one pass, not a copy of the base and then the step (docs/od-sgd.md#step-cost)
            return ops.axpy_into(w, base, -lr, d)
        return ops.axpy_(w, -lr, d)

    # -- checkpoint ---------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The momentum buffers (live references, like torch's optimizer state_dict)."""
        return {"momentum": dict(self.buf)}

    def load_state_dict(self, state: dict, like: dict[str, Tensor]) -> None:
        """Restore buffers, copying into tensors shaped/placed like ``like[name]`` (the model)."""
        self.buf = {}
        for name, t in (state.get("momentum") or {}).items():
            self.buf[name] = self.ops.copy_(self.ops.clone(like[name]), t)
