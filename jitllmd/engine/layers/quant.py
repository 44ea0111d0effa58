"""Quantized weights kept in GGUF's own block layouts, at run time: the projection (`QuantLinear`) and embedding table
(`QuantTable`) that read the blocks through the compiled kernels where they run, else through each format's torch
reference (dequantize, then multiply: runs on any device), and which tokens take which path (`short_feed`,
`chunk_tokens`). The formats themselves, their references and quantizers, are records in formats.py.

A quantized weight [N, K] is N rows of bytes, each row K / block_elems blocks back to back (docs/format.md). Rows are
independent, so q, k and v (or gate and up) stack by concatenating their bytes, even where their types differ (a
Q4_K_M file mixes Q4_K and Q6_K rows): a projection is a list of segments, one per stacked tensor.

Where rounding happens: the tokens of a step's single-token rows (decode rows) are multiplied llama.cpp's way
(kernels/quant.c's quant_rows), each x row quantized to int8 per 32 inputs and dotted in integers, so
|y - x @ W.T| <= sum_k |W[o, k]| * d_k / 2 with d_k that block's amax / 127, nothing else rounding but f32 sums. The
tokens of a longer row (a prompt chunk, whatever its size: a server's prompt chunk must not change a prompt's
numbers): where the kernels have bf16 units (kernels/ops.py's bf16_units: AMX or AVX512_BF16) x and the weights are
rounded to bf16 (to nearest even) and the products summed in f32, a bf16 model's rounding; elsewhere (AVX2, AVX-512
VNNI) an int8 GEMM (quant.c's gemm_rows) with the decode rows' rounding and bound, x's codes the same, its f32 sums
in another order (llama.cpp's rounding, at 2-6x the f32 product over dequantized panels it replaces). Unless the
row's prompt feeds few new tokens (a follow-up turn: at most short_feed, FUSED_FEED below): then each layer takes
its tokens as decode rows in one fused call (layer.c), multiplied as decode rows are where the few-row kernel is the
faster (at most rows_feed new tokens: formats.py's QFormat.short), else (`many`) as a prompt chunk's (bf16 or the
int8 GEMM, as above), decided from that row's own feed. A token's path depends on its own row only, never on the rows beside it. The reference path
(no kernels, or not the CPU) dequantizes and multiplies in f32.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ..kernels import rows_kernel
from ..kernels.ops import (
    BF16Rows,
    Gate,
    bf16_runs,
    bf16_units,
    check_quant_weight,
    dequant_rows,
    gated_rows,
    gemm_runs,
    product_rows,
    quant_runs,
    rms_norm_rows,
)
from ..kv import RowSpan
from .formats import FORMATS, QFormat, dequantize

__all__ = ["QuantLinear", "QuantTable", "Segment", "chunk_tokens", "flag_runs", "segments_for", "take_rows", "short_feed"]


# The most new tokens a short feed may have, per kernel variant: a feed of at most this many runs through each
# layer's fused call (layer.c: no return to Python between its kernels, each token a row attending up to its own
# position), its products the few-row kernel's up to the formats' QFormat.short, a prompt chunk's past it (bf16
# where the CPU has the units, else the int8 GEMM: the rounding the chunk path gives them). Beyond it the prompt
# chunks' path wins (attention a chunk at a time). From bench/short_prompt.py --followup, see docs/performance.md.
# AMX: its prompt rows attend in bf16 on the Python path, so a short feed is only the few-row kernel's (0 here:
# QFormat.short alone).
FUSED_FEED = {"avx2+fma": 64, "avx2+vnni": 64, "avx512+vnni": 64, "avx512+bf16": 64, "avx512+amx": 0}


def short_feed(types: set[str] | list[str], variant: str | None) -> tuple[int, int]:
    """(short_feed, rows_feed) for a model whose quantized tensors are of `types`, under kernel `variant`: the most
    new prompt tokens a row may feed and still run as decode rows do (FUSED_FEED), and the most it may feed and still
    take the few-row integer kernel (the least of its formats' QFormat.short, so no projection runs a feed slower
    than a prompt chunk's product would); past that a short feed's products are a chunk's. (0, 0) where there are no
    kernels or no quantized tensors (a float model's few-row kernels need no marking)."""
    kinds = [FORMATS[t] for t in types if t in FORMATS]
    if variant is None or not kinds:
        return 0, 0
    rows = min(f.short.get(variant, 0) for f in kinds)
    return max(rows, FUSED_FEED.get(variant, 0)), rows


@dataclass(frozen=True)
class Segment:
    """One stacked tensor of a quantized part: `rows` rows of `k` inputs in format `fmt`."""

    fmt: QFormat
    rows: int
    k: int

    @property
    def nbytes(self) -> int:
        return self.rows * self.fmt.row_bytes(self.k)


# -- running them --------------------------------------------------------------------------------------------------


def chunk_tokens(rows: list[RowSpan], num_tokens: int, many: bool = True) -> torch.Tensor | None:
    """bool [T]: the tokens of prompt rows (a row of more than one token, or one marked `prompt`: a chunk's last
    token alone), which quantized projections multiply exactly, but a short feed's (RowSpan.exact), unless `many`
    (a layer without the fused call takes those as a prompt chunk's; with `many` False, as the head does, not: one
    token a row, whose logits a short feed makes as decode rows do); None where there are none."""
    long = [r for r in rows if r.exact or (many and r.many)]
    if not long:
        return None
    mask = torch.zeros(num_tokens, dtype=torch.bool)
    for r in long:
        mask[r.start : r.start + r.num_tokens] = True
    return mask


def flag_runs(flags: torch.Tensor) -> Iterator[tuple[int, int, bool]]:
    """bool [T] -> its runs of equal flags as (start, end, flag): a step's prompt rows and decode rows, each run taken
    by slices (a torch index would wake torch's own threads, which then spin beside the kernels' pool)."""
    kinds, lo = flags.tolist(), 0
    for hi in range(1, len(kinds) + 1):
        if hi == len(kinds) or kinds[hi] != kinds[lo]:
            yield lo, hi, kinds[lo]
            lo = hi


def take_rows(t: torch.Tensor, ids: list[int]) -> torch.Tensor:
    """t's rows `ids` (a new tensor, as t[ids] gives them) by slices, a run of consecutive ids each: no torch index
    (see flag_runs)."""
    runs, lo = [], 0
    for j in range(1, len(ids) + 1):
        if j == len(ids) or ids[j] != ids[j - 1] + 1:
            runs.append(t[ids[lo] : ids[j - 1] + 1])
            lo = j
    return torch.cat(runs) if len(runs) > 1 else (runs[0] if runs else t[:0]).clone()


class QuantLinear:
    """A projection over quantized rows: x [T, in] -> [T, out] f32 (+ bias), added to `residual` where given.

    On the CPU with the kernels: the integer kernel for short rows' tokens (each block read once for all of them),
    with the norm or the gate folded into its quantizing of x and the residual or bias into its sums, one call per
    run of same-format rows; for the tokens `chunk` marks (prompt chunks), the bf16 product where the CPU has bf16
    units, else the int8 GEMM (both fold the norm, the gate and the residual in too). Elsewhere (another device, no
    kernels): the reference, each segment dequantized whole per call."""

    __slots__ = ("bf16_chunks", "bias", "folds", "gemm_chunks", "kernel", "out_features", "runs", "segments", "views")
    panels = False  # the f32 panel kernel's: not this

    def __init__(self, weight: torch.Tensor, segments: list[Segment], bias: torch.Tensor | None):
        flat = weight.reshape(-1)
        if flat.numel() != sum(s.nbytes for s in segments):
            raise ValueError(f"quantized part holds {flat.numel()} bytes, its segments {sum(s.nbytes for s in segments)}")
        merged: list[Segment] = []  # stacked tensors of one format and width are one run of rows: one kernel call
        for s in segments:
            if merged and (merged[-1].fmt, merged[-1].k) == (s.fmt, s.k):
                merged[-1] = Segment(s.fmt, merged[-1].rows + s.rows, s.k)
            else:
                merged.append(s)
        self.segments = merged
        self.views, at = [], 0
        for s in merged:
            self.views.append(flat[at : at + s.nbytes].view(s.rows, s.fmt.row_bytes(s.k)))  # [rows, row bytes]
            at += s.nbytes
        self.out_features = sum(s.rows for s in merged)
        self.bias = None if bias is None else bias.float().contiguous()
        self.kernel = weight.device.type == "cpu" and rows_kernel() is not None  # every format is one the kernels multiply (formats.py)
        self.folds = self.kernel and all(s.k % 8 == 0 for s in merged)  # a norm or the gate made as x rows are quantized
        self.bf16_chunks = self.kernel and bf16_units() is not None  # prompt chunks multiply in bf16 (bf16_runs)
        self.gemm_chunks = self.kernel and not self.bf16_chunks  # ... or as an int8 GEMM (gemm_runs)
        self.runs = [(w, s.fmt.ggml, s.rows) for s, w in zip(merged, self.views)] if self.kernel else []
        for w, qtype, rows in self.runs:
            check_quant_weight(w, qtype, rows, merged[0].k)

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None, *, norm: tuple[torch.Tensor, float] | None = None,
                 gated: Gate = False, chunk: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """x @ W.T (+ bias), added to `residual` where given. With `norm` (weight, eps) the product is of RMSNorm(x) *
        weight, with `gated` of act(gate) * up (silu, or `gated` names it) of x [T, 2 * in]: folded into the kernel's reading of x rows for decode
        rows and for a prompt chunk's product, made first (the same f32 values) where the rows mix or there are no kernels.
        `out`: an f32 [T, out] the kernel writes the result into where it makes it in one call (else returned anew: the
        caller copies)."""
        whole = chunk is None or (self.kernel and bool(chunk.all()))  # one kernel call for every row
        if (norm is not None or gated) and not (self.folds and whole):
            x = rms_norm_rows(x.float(), norm[0], norm[1]) if norm is not None else gated_rows(x.float(), gated)
            norm, gated = None, False
        if self.kernel and whole and (residual is None or (residual.dtype == torch.float32 and residual.is_contiguous())):
            # decode rows, or a prompt chunk: one kernel call per run, the bias or else the residual added in it
            into = out if residual is None or self.bias is None else None
            y = self._run(x.float(), chunk is not None, norm, gated, self.bias if self.bias is not None or residual is None else residual, into)
            return y if residual is None or self.bias is None else residual + y
        inside = residual is not None and self.kernel and self.bias is None and residual.dtype == torch.float32 and residual.is_contiguous()
        y = self.project(x, chunk, norm=norm, gated=gated, add=residual if inside else None, out=out if residual is None or inside else None)
        return y if residual is None or inside else residual + y.to(residual.dtype)

    def rows_bf16(self, x: BF16Rows, spans: list[tuple[int, int]]) -> torch.Tensor:
        """A prompt chunk's bf16 product (`bf16_chunks`) of rows made and rounded once (`bf16_round`) with output rows
        [a, b) of each span only, side by side: [T, sum of the spans' rows], each column the bits the whole product
        gives it."""
        runs, at = [], 0
        for w, qtype, rows in self.runs:
            for a, b in spans:
                lo, hi = max(a, at), min(b, at + rows)
                if lo < hi:
                    runs.append((w[lo - at : hi - at], qtype, hi - lo))
            at += rows
        return bf16_runs(x, runs, sum(b - a for a, b in spans))

    def columns_bf16(self, x: torch.Tensor, k0: int, k1: int, *, gated: Gate = False, add: torch.Tensor | None = None) -> torch.Tensor:
        """add + a prompt chunk's bf16 product over inputs [k0, k1) of every row (k0, k1 on its runs' block
        boundaries): x [T, k1 - k0] (or [T, 2 (k1 - k0)] gated) -> [T, out]."""
        runs = []
        for (w, qtype, rows), s in zip(self.runs, self.segments):
            assert k0 % s.fmt.block == 0 and k1 % s.fmt.block == 0
            runs.append((w[:, k0 // s.fmt.block * s.fmt.nbytes : k1 // s.fmt.block * s.fmt.nbytes], qtype, rows))
        return bf16_runs(x, runs, self.out_features, gated=gated, add=add)

    def project(self, x: torch.Tensor, chunk: torch.Tensor | None = None, *, norm: tuple[torch.Tensor, float] | None = None,
                gated: Gate = False, add: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """x @ W.T (+ bias) [T, out] f32, each row by its own path (`chunk`: a prompt chunk's rows), plus `add` (a
        residual [T, out], with the kernels and no bias only) added in the kernels' sums, into `out` where given. Each
        run of a step's prompt rows, or of its decode rows, is read and written in place: no torch op copies them
        between the kernels' calls (a parallel op there waits, on few cores, for the cores the kernels' pool spun on,
        and its threads then spin beside the pool's)."""
        x = x.float()
        assert add is None or (self.kernel and self.bias is None)
        bias = self.bias if add is None else add
        if chunk is None or not self.kernel:
            return self._run(x, False, norm, gated, bias, out)
        if bool(chunk.all()):  # norm or gated given only where the bf16 product folds them
            return self._run(x, True, norm, gated, bias, out)
        assert norm is None and not gated  # made before: the rows mix
        y = product_rows(out, x.shape[0], self.out_features)
        for lo, hi, exact in flag_runs(chunk):
            self._run(x[lo:hi], exact, add=bias if add is None else add[lo:hi], out=y[lo:hi])
        return y

    def _run(self, x: torch.Tensor, exact: bool, norm: tuple[torch.Tensor, float] | None = None, gated: Gate = False,
             add: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, in] f32 -> add + x @ W.T [T, out] (`add`: a residual [T, out] or a bias [out], or None): the decode rows'
        integer kernel, or (`exact`: a prompt chunk's rows) the bf16 product where the CPU has bf16 units, else the int8
        GEMM; each folds `norm` or `gated` into its reading of x and adds `add` in its sums, into `out` where given.
        Without kernels: the reference, given x made (a new tensor)."""
        if self.kernel and not exact:
            return quant_runs(x, self.runs, self.out_features, norm=norm, gated=gated, add=add, out=out)
        if self.bf16_chunks:
            return bf16_runs(x, self.runs, self.out_features, norm=norm, gated=gated, add=add, out=out)
        if self.gemm_chunks:
            return gemm_runs(x, self.runs, self.out_features, norm=norm, gated=gated, add=add, out=out)
        y = torch.cat([F.linear(x, dequantize(w, s.fmt, s.rows, s.k)) for s, w in zip(self.segments, self.views)], 1)
        return y if add is None else y.add_(add)  # add + y, in y's own storage


class QuantTable:
    """A quantized token-embedding table [V, hidden], resident (a tensor of row bytes) or paged (rows read from the
    file): a lookup dequantizes only the rows it needs. Also the tied head's weight (`linear`)."""

    def __init__(self, table: Any, fmt: QFormat, k: int):
        self.table, self.fmt, self.k = table, fmt, k
        self.paged = hasattr(table, "rows")

    def rows(self, token_ids: torch.Tensor) -> torch.Tensor:
        """token ids [T] -> [T, hidden] f32."""
        kernel = rows_kernel() is not None
        if not self.paged and kernel and self.table.device.type == "cpu" and self.table.is_contiguous():  # gathered as they are read
            table = self.table.reshape(-1, self.fmt.row_bytes(self.k))
            return dequant_rows(table, self.fmt.ggml, table.shape[0], self.k, ids=token_ids)
        raw = self.table.rows(token_ids) if self.paged else self.table.reshape(-1, self.fmt.row_bytes(self.k))[token_ids]  # [T, row bytes]
        n = raw.shape[0]
        if raw.device.type == "cpu" and kernel:
            return dequant_rows(raw.contiguous(), self.fmt.ggml, n, self.k)
        return dequantize(raw, self.fmt, n, self.k)


def segments_for(names: list[str], quantization: dict[str, Any]) -> list[Segment] | None:
    """The segments of a part stacked from `names`, from the .jlm's `quantization` entries ({"type", "shape"});
    None where none of them is quantized. A part that mixes quantized and float tensors cannot stack."""
    entries = [quantization.get(n) for n in names]
    if all(e is None for e in entries):
        return None
    if any(e is None for e in entries):
        raise ValueError(f"{', '.join(names)}: quantized and float tensors cannot stack into one projection")
    out = []
    for n in names:
        e = quantization[n]
        fmt = FORMATS.get(str(e.get("type"))) if isinstance(e, dict) else None
        shape = e.get("shape") if isinstance(e, dict) else None
        if fmt is None or not (isinstance(shape, list) and len(shape) == 2) or shape[1] % fmt.block:
            raise ValueError(f"{n}: bad quantization entry {e!r}")
        out.append(Segment(fmt, int(shape[0]), int(shape[1])))
    return out
