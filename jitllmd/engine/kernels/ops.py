"""The kernels' typed calls: each checks its tensors and hands them to its C entry point (build.py compiles, loads
and declares them). Callers check `rows_kernel()` first; where it is None the engine runs torch's own ops instead.
"""

from __future__ import annotations

import ctypes
from typing import NamedTuple

import torch

from ..layers.formats import BY_GGML
from .build import rows_kernel

__all__ = [
    "BF16_UNITS", "BF16Rows", "GATES", "KV_DTYPES", "MAX_ROWS", "Gate", "QuantLayer", "attend_chunk", "attend_rows", "bf16_attention", "bf16_round",
    "bf16_runs", "bf16_units", "check_quant_weight", "decode_stack", "dequant_rows", "gated_rows", "gemm_runs", "pack_panels", "panel_linear", "product_rows", "quant_rows",
    "quant_runs", "rms_norm_add_rows", "rms_norm_heads", "rms_norm_rows", "rope_rows", "rows_linear", "top_k",
]

MAX_ROWS = 16  # beyond this many rows a step's projections are GEMMs, which torch runs well


def _lib() -> ctypes.CDLL:
    lib = rows_kernel()
    assert lib is not None, "callers check rows_kernel() first"
    return lib


def _operands(x: torch.Tensor, out: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A projection's input as contiguous f32 rows, and its output [rows, out] f32."""
    x = x.float().contiguous()
    return x, torch.empty((x.shape[0], out), dtype=torch.float32)


def rows_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [T, K] f32 @ weight [O, K] (f32 or bf16, contiguous, K a multiple of 8).T -> [T, O] f32, T <= MAX_ROWS."""
    lib = _lib()
    x, y = _operands(x, weight.shape[0])
    (rows, width), out = x.shape, weight.shape[0]
    fn = lib.rows_f32 if weight.dtype == torch.float32 else lib.rows_bf16
    fn(x.data_ptr(), weight.data_ptr(), y.data_ptr(), rows, width, out, torch.get_num_threads())
    return y


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """Rewrite an f32 CPU weight [N, K] (contiguous) in place into panels.c's column-panel layout; returns it. The
    tensor keeps its shape and size but only `panel_linear` reads it right from then on."""
    lib = _lib()
    assert weight.dtype == torch.float32 and weight.is_contiguous() and weight.dim() == 2
    tmp = torch.empty_like(weight)
    lib.pack_panels(weight.data_ptr(), tmp.data_ptr(), weight.shape[0], weight.shape[1], torch.get_num_threads())
    return weight


_PLAIN, _NORMED = 0, 1  # simd.h's inputs
GATES = {"silu": 2, "gelu_tanh": 3}  # the gated MLP's activations the kernels make (simd.h's GATED, GATED_GELU)
Gate = bool | str  # a projection's `gated`: False, or the activation of the gate (True: "silu")


def _gate_mode(gated: Gate) -> int:
    """simd.h's input for a gated MLP's activation."""
    name = "silu" if gated is True else gated
    assert name in GATES, f"gated {gated!r}: one of {sorted(GATES)}"
    return GATES[str(name)]


def _input(x: torch.Tensor, norm: tuple[torch.Tensor, float] | None, gated: Gate) -> tuple[int, int, int, float]:
    """What a kernel makes of x's rows [M, width]: (mode, the product's K, norm weight's address or 0, eps)."""
    width = x.shape[1]
    assert norm is None or not gated, "norm or gated, not both"
    if norm is not None:
        weight, eps = norm
        assert weight.dtype == torch.float32 and weight.is_contiguous() and weight.shape == (width,) and width % 8 == 0
        return _NORMED, width, weight.data_ptr(), float(eps)
    if gated:
        assert width % 16 == 0
        return _gate_mode(gated), width // 2, 0, 0.0
    return _PLAIN, width, 0, 0.0


def panel_linear(
    x: torch.Tensor, panels: torch.Tensor, residual: torch.Tensor | None = None, *, norm: tuple[torch.Tensor, float] | None = None,
    gated: Gate = False,
) -> torch.Tensor:
    """a [M, K] @ W.T (+ residual [M, N] f32) -> [M, N] f32, W [N, K] f32 as `pack_panels` left it; any M. a is x, or
    with `norm` (weight [K] f32, eps) RMSNorm(x) * weight, or when `gated` act(gate) * up of x [M, 2K]: made as the
    rows are packed, so no separate pass writes it (K a multiple of 8 for both)."""
    lib = _lib()
    x, y = _operands(x, panels.shape[0])
    rows, out = x.shape[0], panels.shape[0]
    mode, width, w, eps = _input(x, norm, gated)
    assert panels.shape[1] == width
    res = 0
    if residual is not None:
        residual = residual.float().contiguous()
        assert residual.shape == (rows, out)
        res = residual.data_ptr()
    if lib.panel_linear(x.data_ptr(), panels.data_ptr(), res, y.data_ptr(), rows, out, width, mode, w, eps, torch.get_num_threads()) != 0:
        raise MemoryError("panel_linear: no memory for its packing buffers")
    return y


KV_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.uint8)  # the caches the attention kernels read (uint8: q8_0 rows, pages.py)
_KV_KINDS = {torch.float32: 0, torch.float16: 1, torch.uint8: 2, torch.bfloat16: 3}  # kernels/simd.h KV_F32, KV_F16, KV_Q8, KV_BF16


def _row_meta(keys: list[torch.Tensor], values: list[torch.Tensor], lengths: list[int], starts: list[int], tables: list[int]) -> list[int]:
    """Single-token rows' caches as layer.c reads them: five int64 arrays [R] (keys' and values' pages' addresses,
    lengths, starts, page tables' addresses), one after another. Every cache is a layer's pages [pages, Hkv, PAGE, D]
    contiguous on the CPU, read through the row's int32 page table (engine/pages.py)."""
    return [*(t.data_ptr() for t in keys), *(t.data_ptr() for t in values), *lengths, *starts, *tables]


def _kv_kind(caches: list[torch.Tensor]) -> int:
    """The caches' kind (all of one dtype in KV_DTYPES): f32, f16, bf16 or q8_0 rows (kernels/simd.h)."""
    dtype = caches[0].dtype
    assert dtype in KV_DTYPES and all(t.dtype == dtype for t in caches)
    return _KV_KINDS[dtype]


class _RowMeta:
    """Single-token rows' caches as attend_rows takes them (_row_meta) in one ctypes array (a few times cheaper than a
    tensor of it), and the caches' kind."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], lengths: list[int], starts: list[int], tables: list[int]):
        self.kind = _kv_kind([*keys, *values])
        self.array = (ctypes.c_int64 * (5 * len(keys)))(*_row_meta(keys, values, lengths, starts, tables))
        at, step = ctypes.addressof(self.array), 8 * len(keys)
        self.pointers = [at + i * step for i in range(5)]


def attend_rows(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], lengths: list[int], starts: list[int],
    tables: list[int],
) -> torch.Tensor:
    """Single-token rows' attention in one call. Row r's new k[r], v[r] [Hkv, D] f32 go to position lengths[r] - 1
    of its session's cache: keys[r], values[r] (a layer's pages [pages, Hkv, PAGE, row] contiguous: f32, f16 or bf16 rows
    of D (rounded to nearest), or uint8 q8_0 rows of D + D / 16 bytes (kernels/simd.h)) through the int32 page table at
    address tables[r]; then q[r] [H, D] f32 attends to positions
    starts[r] .. lengths[r] - 1. -> [R, H * D] f32."""
    lib = _lib()
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    num_rows, num_heads, dim = q.shape
    out = torch.empty((num_rows, num_heads * dim), dtype=torch.float32)
    meta = _RowMeta(keys, values, lengths, starts, tables)
    if lib.attend_rows(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), *meta.pointers, num_rows, num_heads, keys[0].shape[1], dim,
                       dim**-0.5, meta.kind, torch.get_num_threads()):
        raise MemoryError("attend_rows: no memory for its scores")
    return out


def attend_chunk(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, table: int, start: int, key_start: int, window: int | None,
                 bf16: bool = False) -> torch.Tensor:
    """A chunk's causal attention against its session's cache. q [n, H, D] are the queries at positions start ..
    start + n - 1, whose keys and values are already in the cache: keys, values (a layer's pages [pages, Hkv, PAGE, row]
    contiguous, f32, f16 or bf16 rows (D a multiple of 4) or q8_0 ones (attend_rows)) through the int32 page table at address `table`; query i sees
    positions max(key_start, start + i - window + 1) .. start + i. -> [n, H * D] f32.
    With `bf16` (where `bf16_attention()`; D a multiple of 32): a bf16 model's rounding on AMX tiles (attend_bf16.c:
    q and the keys rounded for the scores, the softmax's weights and the values for their product, sums in f32)."""
    lib = _lib()
    if q.stride(2) != 1 or q.stride(1) != q.shape[2]:  # heads adjacent in a row; the rows may be wider ones (qkv's)
        q = q.contiguous()
    n, heads, dim = q.shape
    out = torch.empty((n, heads * dim), dtype=torch.float32)
    failed = (lib.attend_chunk_bf16 if bf16 else lib.attend_chunk)(
        q.data_ptr(), q.stride(0), keys.data_ptr(), values.data_ptr(), out.data_ptr(), n, heads, keys.shape[1], dim, table,
        start, key_start, window or 0, dim**-0.5, _kv_kind([keys, values]), torch.get_num_threads(),
    )
    if failed == -2:
        raise ValueError(f"attend_chunk: bf16 attention needs AMX tiles and a head size a multiple of 32 (here {dim}; units: {bf16_units()})")
    if failed:
        raise MemoryError("attend_chunk: no memory for its score buffers")
    return out


def bf16_attention(head_dim: int) -> bool:
    """Whether a prompt chunk's attention can run in bf16 here (`attend_chunk(bf16=True)`): AMX tiles in use, and a
    head size the kernel tiles."""
    return bf16_units() == "amx" and head_dim % 32 == 0


def rms_norm_rows(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of f32 rows x [T, D] by an f32 weight [D] (D a multiple of 8), in f32 as Hugging Face does."""
    lib = _lib()
    x = x.contiguous()
    y = torch.empty_like(x)
    lib.rms_norm_rows(x.data_ptr(), weight.data_ptr(), y.data_ptr(), x.shape[0], x.shape[1], eps, torch.get_num_threads())
    return y


def rms_norm_add_rows(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """residual + RMSNorm(x) * weight for f32 rows x and residual [T, D] (D a multiple of 8), written over x (a
    sublayer's output, no longer needed), or into `out` (product_rows), and returned: the bits of residual +
    rms_norm_rows(x, weight, eps)."""
    lib = _lib()
    assert x.is_contiguous() and residual.is_contiguous() and x.shape == residual.shape and x.dtype == residual.dtype == torch.float32
    y = x if out is None else product_rows(out, x.shape[0], x.shape[1])
    lib.rms_norm_add_rows(x.data_ptr(), weight.data_ptr(), residual.data_ptr(), y.data_ptr(), x.shape[0], x.shape[1], eps, torch.get_num_threads())
    return y


def rms_norm_heads(x: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """RMSNorm in place of each head of f32 x [T, heads, D] (heads adjacent in a row, which may be a view into a wider
    row: q's or k's heads in a qkv product), by weight [D] (D a multiple of 8): rms_norm_rows's values."""
    lib = _lib()
    assert x.dtype == torch.float32 and x.stride(2) == 1 and x.stride(1) == x.shape[2]
    lib.rms_norm_heads(x.data_ptr(), x.stride(0), weight.data_ptr(), x.shape[0], x.shape[1], x.shape[2], eps, torch.get_num_threads())


def rope_rows(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate-half RoPE in place: x [T, heads, D] f32 (heads adjacent in a row, which may be a view into a wider
    row), cos and sin [T, 1, D] (sin's first half negated), D a multiple of 16."""
    lib = _lib()
    assert x.dtype == torch.float32 and x.stride(2) == 1 and x.stride(1) == x.shape[2]
    cos, sin = cos.contiguous(), sin.contiguous()
    rows, heads, dim = x.shape
    lib.rope_rows(x.data_ptr(), x.stride(0), cos.data_ptr(), sin.data_ptr(), rows, heads, dim, torch.get_num_threads())


def gated_rows(gate_up: torch.Tensor, gate: Gate = "silu") -> torch.Tensor:
    """act(gate) * up for f32 rows gate_up [T, 2I] (I a multiple of 8) -> [T, I], in one pass; act silu or gelu's tanh
    form (`GATES`)."""
    lib = _lib()
    gate_up = gate_up.contiguous()
    rows, width = gate_up.shape
    out = torch.empty((rows, width // 2), dtype=torch.float32)
    lib.gated_rows(gate_up.data_ptr(), out.data_ptr(), rows, width // 2, _gate_mode(gate), torch.get_num_threads())
    return out


def check_quant_weight(w: torch.Tensor, qtype: int, n: int, k: int) -> None:
    """Check that w holds n rows of k weights of qtype (a ggml type id, layers/formats.py's BY_GGML): uint8 on the
    CPU, contiguous, [n, row bytes] or 1-D."""
    fmt = BY_GGML.get(qtype)
    if fmt is None:
        raise ValueError(f"qtype {qtype} is not one of the kernels' types {sorted(BY_GGML)}")
    if k % fmt.block:
        raise ValueError(f"{fmt.name} rows hold a multiple of {fmt.block} weights, not {k}")
    row_bytes = fmt.row_bytes(k)
    assert w.dtype == torch.uint8 and w.device.type == "cpu" and w.is_contiguous()
    assert w.shape == (n, row_bytes) if w.dim() == 2 else w.dim() == 1 and w.numel() >= n * row_bytes, (tuple(w.shape), n, row_bytes)


def quant_rows(
    x: torch.Tensor, w: torch.Tensor, qtype: int, n: int, out: torch.Tensor | None = None, *, norm: tuple[torch.Tensor, float] | None = None,
    gated: Gate = False, add: torch.Tensor | None = None,
) -> torch.Tensor:
    """a [T, K] @ W.T -> [T, n] f32 for W n rows of ggml type `qtype` (uint8 bytes, K a multiple of its block),
    llama.cpp's way: a rounded per 32 inputs to int8, integer dot products scaled in f32 (quant.c's header bounds the
    error). a is x (as f32), or with `norm` (weight [K] f32, eps) RMSNorm(x) * weight, or when `gated` act(gate) * up
    of x [T, 2K]: made as a's rows are quantized, bit for bit what rms_norm_rows / gated_rows give. `add`: a
    residual [T, n] or a bias [n] (f32, contiguous) added to the product, as `add + product` would. `out`: an f32
    [T, n] with unit column stride (a column slice of a wider output), written."""
    x = x.float().contiguous()
    rows = x.shape[0]
    check_quant_weight(w, qtype, n, _input(x, norm, gated)[1])
    if out is None:
        out = torch.empty((rows, n), dtype=torch.float32)
    assert out.dtype == torch.float32 and out.device.type == "cpu" and out.shape == (rows, n) and (out.stride(1) == 1 or n == 1)
    if rows and n:
        _quant_runs(x, [(w, qtype, n)], out, norm, gated, add)
    return out


def quant_runs(x: torch.Tensor, runs: list[tuple[torch.Tensor, int, int]], n: int, *, norm: tuple[torch.Tensor, float] | None = None,
               gated: Gate = False, add: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """`quant_rows` over runs of quantized rows stacked along the output, (w, qtype, rows) each, checked once by their
    owner (`check_quant_weight`): a decode step's projection in one kernel call per run, with no other op. -> [T, n] f32
    (`out` where given: product_rows)"""
    x = x.float().contiguous()
    y = product_rows(out, x.shape[0], n)
    if x.shape[0]:
        _quant_runs(x, runs, y, norm, gated, add)
    return y


def gemm_runs(x: torch.Tensor, runs: list[tuple[torch.Tensor, int, int]], n: int, *, norm: tuple[torch.Tensor, float] | None = None,
              gated: Gate = False, add: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """`quant_runs`' product as an int8 GEMM (quant.c's gemm_rows: a prompt chunk's many rows where the CPU has no bf16
    units): x rounded to int8 per 32 inputs exactly as there, the integer sums the same, the f32 steps after them in
    another order (within f32 rounding of quant_runs'; each row's result its own, whatever the rows beside it). -> [T, n]
    (`out` where given: product_rows)"""
    x = x.float().contiguous()
    y = product_rows(out, x.shape[0], n)
    if x.shape[0]:
        _quant_runs(x, runs, y, norm, gated, add, gemm=True)
    return y


def product_rows(out: torch.Tensor | None, rows: int, n: int) -> torch.Tensor:
    """Where a product's rows go: `out` (f32 [rows, n], contiguous: rows of a bigger product's output, say) written in
    place by the kernel, so no copy into it follows (a copy is a parallel torch op: on few cores its threads wait for
    the cores the kernels' pool has just spun on), else a new tensor."""
    if out is None:
        return torch.empty((rows, n), dtype=torch.float32)
    assert out.dtype == torch.float32 and out.shape == (rows, n) and out.is_contiguous(), (out.dtype, tuple(out.shape))
    return out


def _quant_runs(x: torch.Tensor, runs: list[tuple[torch.Tensor, int, int]], y: torch.Tensor, norm: tuple[torch.Tensor, float] | None,
                gated: Gate, add: torch.Tensor | None, gemm: bool = False) -> None:
    lib = _lib()
    fn = lib.gemm_rows if gemm else lib.quant_rows
    T, n = y.shape
    mode, width, norm_w, eps = _input(x, norm, gated)
    add_at, ld_add = 0, 0
    if add is not None:
        assert add.dtype == torch.float32 and add.is_contiguous() and add.shape in ((T, n), (n,)), (add.dtype, tuple(add.shape))
        add_at, ld_add = add.data_ptr(), (n if add.dim() == 2 else 0)
    xp, yp, ldy, threads, col = x.data_ptr(), y.data_ptr(), y.stride(0), torch.get_num_threads(), 0
    for w, qtype, rows in runs:
        if fn(xp, w.data_ptr(), yp + 4 * col, T, width, rows, ldy, qtype, mode, norm_w, eps, add_at + 4 * col if add_at else None, ld_add, threads):
            raise MemoryError(f"{'gemm_rows' if gemm else 'quant_rows'}: no memory for x's int8 codes or a panel's")
        col += rows


BF16_UNITS = {0: None, 1: "avx512_bf16", 2: "amx"}  # bf16_rows_kind's answers


def bf16_units() -> str | None:
    """The units `bf16_runs` multiplies on in the kernels in use: "amx" (AMX tiles, where the build has them and the
    OS grants this process their state), "avx512_bf16" (vdpbf16ps), or None (a variant without bf16, or no kernels)."""
    lib = rows_kernel()
    return None if lib is None else BF16_UNITS[lib.bf16_rows_kind()]


class BF16Rows(NamedTuple):
    """A prompt chunk's rows rounded to bf16 for `bf16_runs` (`bf16_round`): data [Tp, K] bf16, Tp = `rows` rounded
    up to 32, the rows past `rows` zero."""

    data: torch.Tensor
    rows: int


def bf16_round(x: torch.Tensor, *, norm: tuple[torch.Tensor, float] | None = None, gated: Gate = False) -> BF16Rows:
    """x [T, K] f32, or with `norm` RMSNorm(x) * weight, with `gated` act(gate) * up of x [T, 2K] (the f32 values
    rms_norm_rows and gated_rows make), rounded to bf16 (nearest even): the input of `bf16_runs`, made once for
    every product that reads the same rows."""
    lib = _lib()
    x = x.float().contiguous()
    T = x.shape[0]
    mode, width, norm_w, eps = _input(x, norm, gated)
    data = torch.empty(((T + 31) // 32 * 32, width), dtype=torch.bfloat16)
    if lib.bf16_round(x.data_ptr(), data.data_ptr(), T, width, mode, norm_w, eps, torch.get_num_threads()):
        raise ValueError(f"bf16_round: {width} inputs per row is not a multiple of 32")
    return BF16Rows(data, T)


def bf16_runs(x: torch.Tensor | BF16Rows, runs: list[tuple[torch.Tensor, int, int]], n: int, *, norm: tuple[torch.Tensor, float] | None = None,
              gated: Gate = False, add: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """add + bf16(a) @ bf16(W).T over runs of quantized rows (quant_runs's) side by side, the products summed in f32
    (quant.c's bf16_rows: a prompt chunk's product where `bf16_units()` says the CPU has units for it), one call for
    every run. a is `bf16_round(x, norm=norm, gated=gated)`, or x itself where it is already that. A run's w may be a
    column slice of wider rows ([rows, K's bytes], rows w.stride(0) bytes apart: `quant_columns`). -> [T, n] (`out`
    where given: product_rows)"""
    lib = _lib()
    assert not (isinstance(x, BF16Rows) and (norm is not None or gated)), "rows already rounded were made then: no norm or gate to fold"
    xb = x if isinstance(x, BF16Rows) else bf16_round(x, norm=norm, gated=gated)
    T, width = xb.rows, xb.data.shape[1]
    y = product_rows(out, T, n)
    ld_add = 0
    if add is not None:
        assert add.dtype == torch.float32 and add.is_contiguous() and add.shape in ((T, n), (n,)), (add.dtype, tuple(add.shape))
        ld_add = n if add.dim() == 2 else 0
    assert 0 < len(runs) <= 8 and sum(rows for _, _, rows in runs) == n, (len(runs), n)
    for w, qtype, rows in runs:
        fmt = BY_GGML[qtype]
        assert width % fmt.block == 0 and (w.dim() == 1 or w.shape == (rows, fmt.row_bytes(width))), (tuple(w.shape), rows, width)
    if T:
        k = len(runs)
        code = lib.bf16_rows(xb.data.data_ptr(), T, width, k, (ctypes.c_void_p * k)(*(w.data_ptr() for w, _, _ in runs)),
                             (ctypes.c_int64 * k)(*(w.stride(0) if w.dim() == 2 else 0 for w, _, _ in runs)),
                             (ctypes.c_int64 * k)(*(rows for _, _, rows in runs)), (ctypes.c_int * k)(*(t for _, t, _ in runs)),
                             y.data_ptr(), n, None if add is None else add.data_ptr(), ld_add, torch.get_num_threads())
        if code:
            raise MemoryError("bf16_rows: no memory for its panels")
    return y


def dequant_rows(w: torch.Tensor, qtype: int, n: int, k: int, out: torch.Tensor | None = None, ids: torch.Tensor | None = None) -> torch.Tensor:
    """W's n rows of ggml type `qtype` (uint8 bytes) -> [n, k] f32 as gguf.quants.dequantize gives them, or into
    `out` ([n, k] contiguous, f32 or bf16: rounded to nearest even). With `ids` (int64 [m], each < n): rows ids
    only -> [m, k], gathered as they are read (a torch index would wake torch's own threads, which then spin beside
    the kernels' on the step's cores)."""
    lib = _lib()
    check_quant_weight(w, qtype, n, k)
    rows = n if ids is None else ids.shape[0]
    if ids is not None:
        ids = ids.to(torch.long).contiguous()
        if rows and not 0 <= int((bounds := ids.aminmax()).min) <= int(bounds.max) < n:
            raise IndexError(f"dequant_rows: row ids must lie in [0, {n})")
    if out is None:
        out = torch.empty((rows, k), dtype=torch.float32)
    assert out.dtype in (torch.float32, torch.bfloat16) and out.device.type == "cpu" and out.is_contiguous() and out.shape == (rows, k)
    if rows:
        lib.dequant_rows(w.data_ptr(), None if ids is None else ids.data_ptr(), out.data_ptr(), rows, k, qtype, int(out.dtype == torch.bfloat16),
                         torch.get_num_threads())
    return out


_MAX_RUNS = 4  # layer.c's


class _Proj(ctypes.Structure):
    _fields_ = [("runs", ctypes.c_int64), ("k", ctypes.c_int64), ("w", ctypes.c_void_p * _MAX_RUNS), ("type", ctypes.c_int64 * _MAX_RUNS),
                ("rows", ctypes.c_int64 * _MAX_RUNS)]


class _Layer(ctypes.Structure):
    _fields_ = [("qkv", _Proj), ("o", _Proj), ("gate_up", _Proj), ("down", _Proj), ("qkv_bias", ctypes.c_void_p), ("input_norm", ctypes.c_void_p),
                ("post_norm", ctypes.c_void_p), ("eps", ctypes.c_double), ("scale", ctypes.c_double), ("H", ctypes.c_int64), ("Hkv", ctypes.c_int64),
                ("D", ctypes.c_int64), ("hidden", ctypes.c_int64), ("inter", ctypes.c_int64), ("q_norm", ctypes.c_void_p), ("k_norm", ctypes.c_void_p),
                ("attn_out_norm", ctypes.c_void_p), ("mlp_out_norm", ctypes.c_void_p), ("gate", ctypes.c_int64)]


Runs = list[tuple[torch.Tensor, int, int]]  # (w, qtype, rows): quant_runs's
_MANY_GEMM, _MANY_BF16 = 1, 2  # layer.c's flags: a row's products the int8 GEMM's, or bf16's


class QuantLayer:
    """A decoder layer's quantized projections, norms and shape as layer.c's decode_layer reads them (the tensors kept
    alive here). Projections are runs (quant_runs's), each checked by its owner; `qkv_bias` [(H + 2 Hkv) D] or None.
    Gemma's layer also has per-head q and k norms ([D]), norms of the attention's and the MLP's outputs before they
    join the stream ([hidden]) and a gelu gate: None and "silu" for Llama's. Every norm takes `eps`."""

    def __init__(self, qkv: tuple[Runs, int], o: tuple[Runs, int], gate_up: tuple[Runs, int], down: tuple[Runs, int],
                 qkv_bias: torch.Tensor | None, input_norm: torch.Tensor, post_norm: torch.Tensor, eps: float, heads: int, kv_heads: int,
                 head_dim: int, *, q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None,
                 attn_out_norm: torch.Tensor | None = None, mlp_out_norm: torch.Tensor | None = None, gate: Gate = "silu"):
        parts = (qkv, o, gate_up, down)
        if any(len(runs) > _MAX_RUNS for runs, _ in parts):
            raise ValueError(f"decode_layer takes at most {_MAX_RUNS} runs of rows per projection")
        norms = (q_norm, k_norm, attn_out_norm, mlp_out_norm)
        self.keep = [input_norm, post_norm, qkv_bias, *norms, *(w for runs, _ in parts for w, _, _ in runs)]
        for t in self.keep[:7]:
            assert t is None or (t.dtype == torch.float32 and t.is_contiguous() and t.device.type == "cpu")
        hidden, inter = sum(rows for _, _, rows in o[0]), down[1]
        self.hidden, self.struct = hidden, _Layer()
        for name, (runs, k) in zip(("qkv", "o", "gate_up", "down"), parts):
            proj = getattr(self.struct, name)
            proj.runs, proj.k = len(runs), k
            for i, (w, qtype, rows) in enumerate(runs):
                proj.w[i], proj.type[i], proj.rows[i] = w.data_ptr(), qtype, rows
        L = self.struct
        L.qkv_bias = None if qkv_bias is None else qkv_bias.data_ptr()
        L.input_norm, L.post_norm, L.eps, L.scale = input_norm.data_ptr(), post_norm.data_ptr(), eps, head_dim**-0.5
        L.H, L.Hkv, L.D, L.hidden, L.inter = heads, kv_heads, head_dim, hidden, inter
        L.q_norm, L.k_norm, L.attn_out_norm, L.mlp_out_norm = (None if t is None else t.data_ptr() for t in norms)
        L.gate = _gate_mode(gate)
        self.address = ctypes.addressof(L)


def decode_stack(layers: list[QuantLayer], x: torch.Tensor, rope: list[tuple[torch.Tensor, torch.Tensor]], keys: list[list[torch.Tensor]],
                 values: list[list[torch.Tensor]], lengths: list[list[int]], starts: list[list[int]], tables: list[list[int]],
                 many: list[bool] | None = None) -> torch.Tensor:
    """Each of `layers`' decode step in turn, in one call (layer.c's decode_stack over its decode_layer: a step returns
    to Python once, not once a layer). For R single-token rows x [R, hidden] f32 -> [R, hidden]: norm, qkv, the q/k
    norms (Gemma's), RoPE (rope[l]: cos, sin [R, 1, D] as rope_rows takes them), each row's attention against its cache
    (keys[l][r], values[l][r]: layer l's pages, f32 or f16, through the page table at tables[l][r] (attend_rows), its
    new K/V written at lengths[l][r] - 1, keys from starts[l][r]), o (normed, Gemma's) and the residual, norm, gate_up, the gate and down (normed) and the residual: the
    calls the Python path makes, with the same bits. `many`: per row, whether its products are a prompt chunk's
    (bf16_runs' where the CPU has bf16 units, else the int8 GEMM's: gemm_runs) rather than the few-row kernel's (a
    short feed past `rows_feed`); None: none are."""
    lib = _lib()
    R = x.shape[0]
    assert x.dtype == torch.float32 and x.is_contiguous() and x.shape[1] == layers[0].hidden
    assert len(rope) == len(keys) == len(values) == len(lengths) == len(starts) == len(tables) == len(layers) and (many is None or len(many) == R)
    kv_kind = _kv_kind([t for ks, vs in zip(keys, values) for t in (*ks, *vs)])
    rope = [(c.contiguous(), s.contiguous()) for c, s in rope]
    meta = (ctypes.c_int64 * (5 * R * len(layers)))(*(v for ks, vs, ls, ss, ts in zip(keys, values, lengths, starts, tables) for v in _row_meta(ks, vs, ls, ss, ts)))
    addresses = (ctypes.c_void_p * len(layers))(*(layer.address for layer in layers))
    cos = (ctypes.c_void_p * len(layers))(*(c.data_ptr() for c, _ in rope))
    sin = (ctypes.c_void_p * len(layers))(*(s.data_ptr() for _, s in rope))
    kind = _MANY_BF16 if many is not None and any(many) and bf16_units() is not None else _MANY_GEMM
    flags = None if many is None or not any(many) else (ctypes.c_uint8 * R)(*(kind if m else 0 for m in many))
    y = torch.empty_like(x)
    if lib.decode_stack(addresses, len(layers), x.data_ptr(), y.data_ptr(), R, cos, sin, meta, kv_kind, flags,
                        torch.get_num_threads()):
        raise MemoryError("decode_stack: no memory for its buffers")
    return y


def top_k(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest of f32 x [V] on the CPU (0 < k <= V), descending, the lower id first among equals -> (values f32,
    ids int64), k of each, or fewer where x holds fewer numbers (NaNs are passed over)."""
    x = x.contiguous()
    values, ids = torch.empty(k, dtype=torch.float32), torch.empty(k, dtype=torch.long)
    have = _lib().top_k(x.data_ptr(), x.shape[0], k, values.data_ptr(), ids.data_ptr())
    return (values, ids) if have == k else (values[:have], ids[:have])
