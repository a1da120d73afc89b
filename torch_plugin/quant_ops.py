"""TorchOps' low-bit quantisation kernels (docs/quantize.md#device): ``quantize_blocks``,
``dequantize_blocks``, ``pack_bits``, ``unpack_bits`` of :class:`hvd_commopt.tensor_ops.TensorOps`
as torch ops, on the tensor's device (a CUDA bucket makes no host round trip). A mixin, so that
torch_plugin/ops.py stays under 400 lines.

Bit-exact with the NumPy reference (:class:`hvd_commopt.numpy_ops.NumpyOps`): float32 division
and products (IEEE, correctly rounded on CPU and CUDA), ``torch.round`` rounds half to even as
``numpy.rint`` does, and the packing is one bit stream, least significant bit first, which for
2 and 4 bits is the reference's whole codes per byte.
"""
from __future__ import annotations

import torch

__all__ = ["QuantKernels"]


def _levels(bits: int) -> int:
    return (1 << (bits - 1)) - 1


def _blocks(t: torch.Tensor, n: int, block: int) -> torch.Tensor:
    """t's n values zero-padded to whole blocks, as (blocks, block)."""
    nb = -(-n // block)
    if n == nb * block and t.dtype == torch.float32:  # whole blocks: a view (the callers only read it)
        return t.reshape(nb, block)
    flat = torch.zeros(nb * block, dtype=torch.float32, device=t.device)
    flat[:n] = t.reshape(-1)
    return flat.view(nb, block)


def _pack_whole(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """2 and 4 bits: ``8 // bits`` whole codes per byte, the first in the lowest bits: the same
    bytes as the bit stream, in uint8 ops on strided views, without expanding each code into
    ``bits`` int32 values (4 bits on 1.4M codes: the stream took 10x the time of the quantisation
    itself on a CPU)."""
    per = 8 // bits
    pad = -codes.numel() % per
    c = torch.cat([codes, codes.new_zeros(pad)]) if pad else codes
    out = c[0::per].clone()
    for j in range(1, per):
        out.bitwise_or_(c[j::per] << (bits * j))
    return out


def _unpack_whole(buf: torch.Tensor, n: int, bits: int) -> torch.Tensor:
    """The inverse of :func:`_pack_whole`: n codes."""
    mask = (1 << bits) - 1
    parts = [(buf >> (bits * j)) & mask for j in range(8 // bits)]
    return torch.stack(parts, dim=1).reshape(-1)[:n]


class QuantKernels:
    """The quantisation kernels of :class:`torch_plugin.ops.TorchOps`."""

    @torch.no_grad()
    def quantize_blocks(self, t, bits, block):
        n, q = t.numel(), _levels(bits)
        xp = _blocks(t, n, block)
        scale = xp.abs().amax(dim=1) / q if n else xp.new_zeros(0)
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        codes = torch.clamp(torch.round(xp / safe[:, None]), -q, q)
        dec = (codes * scale[:, None]).reshape(-1)[:n]
        return scale, (codes.reshape(-1)[:n] + q).to(torch.uint8), dec

    @torch.no_grad()
    def dequantize_blocks(self, scales, codes, bits, block):
        n = codes.numel()
        c = _blocks(codes.to(torch.float32) - _levels(bits), n, block)
        return (c * scales[:, None]).reshape(-1)[:n]

    @torch.no_grad()
    def pack_bits(self, codes, bits):
        if bits == 8:
            return codes
        if bits in (2, 4) and codes.numel():
            return _pack_whole(codes, bits)
        n, dev = codes.numel(), codes.device
        stream = ((codes.to(torch.int32)[:, None] >> torch.arange(bits, device=dev, dtype=torch.int32)) & 1).reshape(-1)
        pad = -stream.numel() % 8
        if pad:
            stream = torch.cat([stream, stream.new_zeros(pad)])
        weights = torch.arange(8, device=dev, dtype=torch.int32)
        out = (stream.view(-1, 8) << weights).sum(dim=1, dtype=torch.int32)  # disjoint bits: the sum is the or
        return out.to(torch.uint8) if n else codes.new_zeros(0)

    @torch.no_grad()
    def unpack_bits(self, buf, n, bits):
        if bits == 8:
            return buf[:n]
        if bits in (2, 4):
            return _unpack_whole(buf, n, bits)
        dev = buf.device
        stream = ((buf.to(torch.int32)[:, None] >> torch.arange(8, device=dev, dtype=torch.int32)) & 1).reshape(-1)
        planes = stream[:n * bits].view(n, bits)
        return (planes << torch.arange(bits, device=dev, dtype=torch.int32)).sum(dim=1, dtype=torch.int32).to(torch.uint8)

    @torch.no_grad()
    def topk_abs_rows(self, t, width, k):
        rows = t.numel() // width
        if k == 0 or rows == 0:
            return torch.zeros(0, dtype=torch.int64, device=t.device)
        comp = t.detach().reshape(rows, width).abs().view(torch.int32).to(torch.int64)  # one new buffer, then in place
        comp.clamp_(max=0x7F800001).mul_(width).add_(torch.arange(width - 1, -1, -1, device=t.device, dtype=torch.int64))
        return torch.topk(comp, k, dim=1, largest=True, sorted=True).indices.reshape(-1)  # unique keys: no ties
