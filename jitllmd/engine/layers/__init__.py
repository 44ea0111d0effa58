"""Operations a model family composes, one home each; every layer picks its kernel once, when it is built."""

from __future__ import annotations

from .activation import GatedAct
from .attention import Attention
from .linear import Linear, Projection, make_linear
from .norm import RMSNorm
from .quant import QuantLinear, QuantTable, Segment, chunk_tokens, segments_for
from .rope import Rope, RopeTables, rope_inv_freq

__all__ = ["Attention", "Linear", "Projection", "QuantLinear", "QuantTable", "RMSNorm", "Rope", "RopeTables", "Segment", "GatedAct", "chunk_tokens", "make_linear",
           "rope_inv_freq",
           "segments_for"]
