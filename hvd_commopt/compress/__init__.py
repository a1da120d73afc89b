"""What is sent: dense compressors (one file per method) and the sparse selectors. What is kept
(error feedback, DGC's memory) is in :mod:`hvd_commopt.memory`."""
from .base import Compressor
from .cast import BF16Compressor, FP16Compressor, NoneCompressor
from .dgc import DGCSelector
from .randomk import RandomKSelector
from .selector import Density, DensitySpec, Selector, check_density
from .ternary import TernaryCompressor, wire_dtype_for
from .topk import TopKSelector

__all__ = ["Compressor", "NoneCompressor", "FP16Compressor", "BF16Compressor", "TernaryCompressor",
           "wire_dtype_for", "Selector", "TopKSelector", "RandomKSelector", "DGCSelector", "Density", "DensitySpec",
           "check_density"]
