"""Compressors (what moves): one file per method, plus the error-feedback memory."""
from .base import Compressor
from .cast import BF16Compressor, FP16Compressor, NoneCompressor
from .dgc import DGCCompressor, DGCMemory
from .error_feedback import ErrorFeedback
from .randomk import RandomKCompressor
from .topk import DensitySpec, SparseCompressor, TopKCompressor

__all__ = ["Compressor", "NoneCompressor", "FP16Compressor", "BF16Compressor", "SparseCompressor",
           "TopKCompressor", "RandomKCompressor", "DGCCompressor", "DGCMemory", "ErrorFeedback", "DensitySpec"]
