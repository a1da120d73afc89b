"""Compressors (what moves): one file per method."""
from .base import Compressor
from .cast import BF16Compressor, FP16Compressor, NoneCompressor

__all__ = ["Compressor", "NoneCompressor", "FP16Compressor", "BF16Compressor"]
