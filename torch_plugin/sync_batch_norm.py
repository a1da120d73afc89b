"""SyncBatchNorm: batch normalisation with the batch statistics of every rank's batch.

In training, each rank's per-channel sum, sum of squares and element count are summed over
ranks with the differentiable allreduce (op Sum, whose gradient is again a Sum allreduce, so
backward is exact), giving the global mean and biased variance; the running statistics take the
unbiased variance, as torch.nn.BatchNorm does. Evaluation uses the running statistics.
"""
from __future__ import annotations

import torch

from hvd_commopt.reduce import Sum

from ._compat import BatchNormBase
from .functions import allreduce

__all__ = ["SyncBatchNorm"]


class SyncBatchNorm(BatchNormBase):  # torch's _BatchNorm, through _compat
    """Drop-in for torch.nn.BatchNorm1d/2d/3d (inputs of 2 to 5 dimensions, channels in dim 1)."""

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True, track_running_stats=True,
                 process_set=None):
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        self.process_set = process_set

    def _check_input_dim(self, input):
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        if not (self.training or not self.track_running_stats):  # eval: the running statistics
            return torch.nn.functional.batch_norm(input, self.running_mean, self.running_var, self.weight,
                                                  self.bias, False, 0.0, self.eps)
        dims = [0] + list(range(2, input.dim()))
        count = torch.full((1,), input.numel() // input.shape[1], dtype=input.dtype, device=input.device)
        local = torch.cat([input.sum(dims), (input * input).sum(dims), count])
        total = allreduce(local, op=Sum, name="sync_batch_norm", process_set=self.process_set)
        c = self.num_features
        n = total[2 * c]
        mean = total[:c] / n
        var = total[c:2 * c] / n - mean * mean
        if self.training and self.track_running_stats:
            with torch.no_grad():
                self.num_batches_tracked += 1
                m = self.momentum if self.momentum is not None else 1.0 / float(self.num_batches_tracked)
                unbiased = var * (n / (n - 1)) if float(n) > 1 else var
                self.running_mean.mul_(1 - m).add_(mean.detach(), alpha=m)
                self.running_var.mul_(1 - m).add_(unbiased.detach(), alpha=m)
        shape = [1, c] + [1] * (input.dim() - 2)
        out = (input - mean.view(shape)) / torch.sqrt(var.view(shape) + self.eps)
        if self.affine:
            out = out * self.weight.view(shape) + self.bias.view(shape)
        return out
