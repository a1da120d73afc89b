"""Compressors and selectors (what moves): one file per method, plus the memories (what is kept)."""
from .base import Compressor
from .cast import BF16Compressor, FP16Compressor, NoneCompressor
from .dgc import DGCCompressor, DGCMemory
from .error_feedback import ErrorFeedback
from .memory import Memory
from .randomk import RandomKCompressor
from .ternary import TernaryCompressor, wire_dtype_for
from .topk import DensitySpec, SparseCompressor, TopKCompressor

__all__ = ["Compressor", "NoneCompressor", "FP16Compressor", "BF16Compressor", "TernaryCompressor",
           "wire_dtype_for", "SparseCompressor", "TopKCompressor", "RandomKCompressor", "DGCCompressor",
           "Memory", "DGCMemory", "ErrorFeedback", "DensitySpec"]
