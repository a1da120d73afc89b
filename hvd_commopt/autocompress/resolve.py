"""``compression="auto"`` as the engine's reducer, or dense where no compressor applies."""
from __future__ import annotations

import warnings
from typing import Any

from ..reduce.base import Adasum
from .reducer import AutoReducer

__all__ = ["resolve_auto", "AUTO"]

AUTO = "auto"


def resolve_auto(compression: Any, op: str) -> Any:
    """``compression`` with the string ``"auto"`` made an :class:`AutoReducer` (the defaults of
    ``Compression.auto()``). With ``op=Adasum``, which combines dense gradients, no compressor
    applies: None (dense) with one warning saying why. Anything else is returned as it is."""
    if isinstance(compression, str) and compression == AUTO:
        compression = AutoReducer()
    if isinstance(compression, AutoReducer) and op == Adasum:
        warnings.warn("compression='auto' with op=Adasum: Adasum combines whole dense gradients, so no "
                      "compressor applies; sending them dense fp32", stacklevel=3)
        return None
    return compression
