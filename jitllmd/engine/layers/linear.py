"""Projections: x @ W.T (+ bias), run the way the device runs it fastest. `make_linear` picks the class for a weight's
kind; dense weights are `Linear`, and a quantized kind is a sibling class here with its own kernels."""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from ..kernels import rows_kernel
from ..kernels.ops import MAX_ROWS, Gate, pack_panels, panel_linear, rows_linear
from ..memory.devices import bf16_matmul_native
from .quant import QuantLinear, Segment

__all__ = ["ROW_BLOCK_MAX_TOKENS", "Linear", "Projection", "make_linear"]

# Up to this many tokens (decode rows of a batched step), f32 projections stay weight-stationary row-block GEMMs:
# MKL's sgemm with a transposed weight and a small M reads the weight far slower (measured, SmolLM2 f32 step:
# 2 rows 86 ms as F.linear against 28 ms for 1 row as row blocks).
ROW_BLOCK_MAX_TOKENS = 32
_UPCAST_MIN_TOKENS = 8  # below this an emulated bf16 GEMV beats upcasting the weight


class Projection(Protocol):
    """What a block calls: x [T, in] -> [T, out], added to `residual` where given. `panels`: the kernel can fold a
    norm (`norm`) or the MLP's gate (`gated`) into how it packs its input. `chunk` (bool [T], or None): the tokens of
    prompt chunks (layers/quant.py's chunk_tokens), which a quantized projection multiplies by its prompt path (bf16 or the int8 GEMM).
    `out`: f32 [T, out] the result may be written into (the caller copies one returned elsewhere)."""

    panels: bool
    folds: bool  # takes `norm` and `gated`

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None, *, norm: tuple[torch.Tensor, float] | None = None,
                 gated: Gate = False, chunk: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor: ...


def make_linear(weight: torch.Tensor, bias: torch.Tensor | None, *, panels: bool = False, segments: list[Segment] | None = None) -> Projection:
    """The projection for a weight, as stored, on its device: a dense f32/bf16/f16 tensor [out, in] is a `Linear`
    (bf16 upcast where the device has no bf16 units; f32 on the CPU split in row blocks, one per thread). `panels`:
    the weight stays, so an f32 one on the CPU may be rewritten into panels. `segments`: the weight is quantized
    rows (layers/quant.py), a `QuantLinear`."""
    if segments is not None:
        return QuantLinear(weight, segments, bias)
    cpu = weight.device.type == "cpu"
    upcast = weight.dtype == torch.bfloat16 and not bf16_matmul_native(weight.device)
    chunks = torch.get_num_threads() if cpu and weight.dtype == torch.float32 else 1
    return Linear(weight, bias, upcast=upcast, chunks=chunks, panels=panels)


class Linear:
    """A projection, run the way the device runs it fastest (measured on 2-core AVX2 CPUs, bench/decode.py).

    f32 weights a block keeps on the CPU (`panels`): rewritten once, in place, into column panels that one compiled
    kernel multiplies for any number of rows, ~185 GFLOP/s on a prompt where MKL's sgemm reaches ~145 (it repacks
    the weight every call), and one pass over the weights for a decode step's rows. Other f32 weights on the CPU
    (a paged block's, read for one turn; a tied head's, shared with the embedding): the few-row kernel, else one
    batched GEMV per thread over row blocks of the weight (a view, no copy), ~20 GB/s where one sgemv call reaches
    ~13. bf16 on a CPU without bf16 units: many-token batches multiply in f32 (the weight upcast per call, the
    result rounded to bf16 as a bf16 GEMM's is); single tokens run the emulated bf16 GEMV, which is still
    memory-bound.
    """

    __slots__ = ("bias", "chunks", "folds", "panels", "row_blocks", "rows", "upcast", "weight")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, *, upcast: bool = False, chunks: int = 1, panels: bool = False):
        self.panels = (
            panels and weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.is_contiguous() and weight.dim() == 2
            and rows_kernel() is not None
        )
        self.weight = pack_panels(weight) if self.panels else weight  # [out, in]; panels: same bytes, panel order
        self.folds = self.panels
        self.bias = bias
        self.upcast = upcast
        self.chunks = chunks if chunks > 1 and weight.shape[0] % chunks == 0 and not self.panels else 1
        o, i = weight.shape
        self.row_blocks = weight.view(self.chunks, o // self.chunks, i)  # [chunks, out/chunks, in], a view
        self.rows = (  # the few-row kernel (engine/kernels): each weight row read once for all of a step's rows
            not self.panels and weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.bfloat16)
            and weight.is_contiguous() and i % 8 == 0 and rows_kernel() is not None
        )

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None, *, norm: tuple[torch.Tensor, float] | None = None,
                 gated: Gate = False, chunk: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """x @ W.T (+ bias), added to `residual` where one is given (by the panel kernel, in its first pass). Panels
        only: with `norm` (weight, eps) the product is of RMSNorm(x) * weight, with `gated` of silu(gate) * up of x
        [T, 2 * in], made as the kernel packs its rows. Every token is multiplied alike: `chunk` changes nothing;
        `out` is not written (a new tensor is returned)."""
        if self.panels:
            y = panel_linear(x, self.weight, residual, norm=norm, gated=gated)
            return y if self.bias is None else y + self.bias
        assert norm is None and not gated, "only the panel kernel folds a norm or the gate into its input"
        y = self.project(x)
        # the stream keeps its dtype: a bf16 stream adds the product rounded to bf16, as a bf16 GEMM's would be
        return y if residual is None else residual + y.to(residual.dtype)

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W.T (+ bias) where the weight keeps its [out, in] layout."""
        T = x.shape[0]
        if self.rows and 0 < T <= MAX_ROWS:
            y = rows_linear(x, self.weight)  # [T, out] f32, bf16 weights widened exactly: kept in f32, never less exact
            return y if self.bias is None else y + self.bias
        if self.chunks > 1 and 0 < T <= ROW_BLOCK_MAX_TOKENS:
            c = self.chunks
            y = torch.bmm(x.expand(c, T, x.shape[1]), self.row_blocks.transpose(1, 2))  # [c, T, o/c]: each thread reads its rows once
            y = y.view(1, -1) if T == 1 else y.transpose(0, 1).reshape(T, -1)  # [T, o]
            return y if self.bias is None else y + self.bias
        if self.upcast and x.shape[0] >= _UPCAST_MIN_TOKENS:
            b = None if self.bias is None else self.bias.float()
            return F.linear(x.float(), self.weight.float(), b).to(self.weight.dtype)
        return F.linear(x.to(self.weight.dtype), self.weight, self.bias)
