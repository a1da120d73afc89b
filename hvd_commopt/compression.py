"""``Compression``: the user-facing namespace of compression choices (Horovod's names kept).

``Compression.none`` and ``Compression.fp16`` are values, as in Horovod, so
``compression=hvd.Compression.fp16`` keeps working after changing the import.
"""
from __future__ import annotations

from .compress.cast import BF16Compressor, FP16Compressor, NoneCompressor

__all__ = ["Compression"]


class Compression:
    """Compression choices for ``DistributedOptimizer(compression=...)``."""

    none = NoneCompressor()
    fp16 = FP16Compressor()
    bf16 = BF16Compressor()
