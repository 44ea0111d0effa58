"""The compiled kernels against torch's own ops (few-row and panel projections, attention, RMSNorm, silu); where builds are kept."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from jitllmd.engine.kernels import describe, rows_kernel, use_variant, variants
from jitllmd.engine.kernels.ops import (
    MAX_ROWS,
    attend_chunk,
    attend_rows,
    bf16_attention,
    bf16_units,
    gated_rows,
    pack_panels,
    panel_linear,
    rms_norm_add_rows,
    rms_norm_heads,
    rms_norm_rows,
    rope_rows,
    rows_linear,
    top_k,
)
from jitllmd.engine.pages import PAGE, dequantize_q8, quantize_q8

pytestmark = pytest.mark.skipif(rows_kernel() is None, reason="no C compiler or no AVX2/FMA here: the engine runs torch's ops")


class _Paged:
    """A contiguous cache [Hkv, L, D] laid out as the kernels read a session's: pages [pages, Hkv, PAGE, D] in a
    shuffled order (and two more, NaN, that no table names) through an int32 page table."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, seed: int = 0):
        Hkv, L, D = keys.shape
        self.length, num = L, -(-L // PAGE)
        order = torch.randperm(num + 2, generator=torch.Generator().manual_seed(seed))[:num].tolist()
        self.table = (ctypes.c_int32 * max(1, num))(*order)
        self.pages = []
        for cache in (keys, values):
            store = torch.full((num + 2, Hkv, PAGE, D), float("nan") if cache.is_floating_point() else 0, dtype=cache.dtype)
            for i, page in enumerate(order):
                run = cache[:, i * PAGE : (i + 1) * PAGE]
                store[page, :, : run.shape[1]] = run
            self.pages.append(store)

    @property
    def address(self) -> int:
        return ctypes.addressof(self.table)

    def cache(self, which: int) -> torch.Tensor:
        """The keys (0) or values (1) back as [Hkv, L, D]."""
        store = self.pages[which]
        return torch.cat([store[p] for p in self.table], dim=1)[:, : self.length]


def _rows(q, k, v, keys, values, lengths, starts):
    """attend_rows over each row's cache paged; the new K/V it wrote copied back into the contiguous caches."""
    paged = [_Paged(kk, vv, seed=r) for r, (kk, vv) in enumerate(zip(keys, values))]
    out = attend_rows(q, k, v, [p.pages[0] for p in paged], [p.pages[1] for p in paged], lengths, starts, [p.address for p in paged])
    for p, kk, vv in zip(paged, keys, values):
        kk.copy_(p.cache(0))
        vv.copy_(p.cache(1))
    return out


def _chunk(q, keys, values, start, key_start, window, bf16=False):
    """attend_chunk over the cache paged."""
    p = _Paged(keys, values, seed=start)
    return attend_chunk(q, p.pages[0], p.pages[1], p.address, start, key_start, window, bf16)


@pytest.mark.parametrize("variant", variants())
@pytest.mark.parametrize("narrow", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
def test_an_f16_cache_is_an_f32_cache_of_f16_values(variant: str, narrow: torch.dtype) -> None:
    """A kept-quantized model's f16 K/V (a bf16 model's bf16 K/V): attend_rows rounds the new K/V as torch's .half()
    (.bfloat16()) does and reads the cache widened, so its output is bit for bit the f32 kernel's over the same
    values; attend_chunk likewise (in bf16 too, where AMX runs)."""
    use_variant(variant)
    try:
        g = torch.Generator().manual_seed(3)
        H, Hkv, D, cap = 6, 2, 64, 300
        keys16 = [torch.randn(Hkv, cap, D, generator=g).to(narrow) for _ in range(3)]
        values16 = [torch.randn(Hkv, cap, D, generator=g).to(narrow) for _ in range(3)]
        keys32, values32 = [t.float() for t in keys16], [t.float() for t in values16]
        lengths, starts = [12, 300, 1], [0, 150, 0]
        q, k, v = torch.randn(3, H, D, generator=g), torch.randn(3, Hkv, D, generator=g), torch.randn(3, Hkv, D, generator=g)
        out16 = _rows(q, k, v, keys16, values16, lengths, starts)
        out32 = _rows(q, k.to(narrow).float(), v.to(narrow).float(), keys32, values32, lengths, starts)
        assert torch.equal(out16, out32)
        for r in range(3):
            assert torch.equal(keys16[r].float(), keys32[r]) and torch.equal(values16[r].float(), values32[r])
        n, start = 70, 100  # a later chunk: its keys span blocks of 64, the last one partial
        qc = torch.randn(n, H, D, generator=g)
        for window in (None, 50):
            assert torch.equal(_chunk(qc, keys16[1], values16[1], start, 0, window), _chunk(qc, keys32[1], values32[1], start, 0, window))
        if bf16_attention(D):
            narrow_bf16, wide_bf16 = (_chunk(qc, ks[1], vs[1], start, 0, None, True) for ks, vs in ((keys16, values16), (keys32, values32)))
            assert torch.equal(narrow_bf16, wide_bf16)
        odd16 = torch.randn(1, 40, 12, generator=g).to(narrow)  # a head size that is no multiple of 8: the widening's tail
        qo = torch.randn(9, 2, 12, generator=g)
        assert torch.equal(_chunk(qo, odd16, odd16, 3, 0, None), _chunk(qo, odd16.float(), odd16.float(), 3, 0, None))
    finally:
        use_variant(None)


@pytest.mark.parametrize("variant", variants())
@pytest.mark.parametrize("dim", [64, 128, 96, 32])
def test_a_q8_0_cache_is_an_f32_cache_of_its_values(variant: str, dim: int) -> None:
    """A q8_0 KV cache (-kv-dtype q8_0): attend_rows quantizes the new K/V as the torch reference does (bit for bit)
    and reads each block widened to its values, so its output is the f32 kernel's over the dequantized cache; the
    chunk kernels likewise (in bf16 too, where AMX runs)."""
    use_variant(variant)
    try:
        g = torch.Generator().manual_seed(5)
        H, Hkv, cap = 6, 2, 300
        keys32 = [torch.randn(Hkv, cap, dim, generator=g) for _ in range(3)]
        values32 = [torch.randn(Hkv, cap, dim, generator=g) * 3 for _ in range(3)]
        keys8, values8 = [quantize_q8(t) for t in keys32], [quantize_q8(t) for t in values32]
        keysd, valuesd = [dequantize_q8(t, dim) for t in keys8], [dequantize_q8(t, dim) for t in values8]
        lengths, starts = [12, 300, 1], [0, 150, 0]
        q, k, v = torch.randn(3, H, dim, generator=g), torch.randn(3, Hkv, dim, generator=g), torch.randn(3, Hkv, dim, generator=g)
        k[0, 0, :32] = 0.0  # a block of zeros: scale 0, every integer 0
        out8 = _rows(q, k, v, keys8, values8, lengths, starts)
        outd = _rows(q, dequantize_q8(quantize_q8(k), dim), dequantize_q8(quantize_q8(v), dim), keysd, valuesd, lengths, starts)
        assert torch.equal(out8, outd)
        for r in range(3):
            assert torch.equal(keys8[r][:, lengths[r] - 1], quantize_q8(k[r])) and torch.equal(values8[r][:, lengths[r] - 1], quantize_q8(v[r]))
        assert (dequantize_q8(quantize_q8(k), dim) - k).abs().max() <= k.abs().max() / 127  # half a step of the largest block, at most
        n, start = 70, 100
        qc = torch.randn(n, H, dim, generator=g)
        for window in (None, 50):
            assert torch.equal(_chunk(qc, keys8[1], values8[1], start, 0, window), _chunk(qc, keysd[1], valuesd[1], start, 0, window))
            if bf16_attention(dim):
                assert torch.equal(_chunk(qc, keys8[1], values8[1], start, 0, window, bf16=True),
                                   _chunk(qc, keysd[1], valuesd[1], start, 0, window, bf16=True))
    finally:
        use_variant(None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_linear_matches_torch(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(200, 64, generator=g).to(dtype)
    for rows in (1, 3, 8, 9, MAX_ROWS):
        x = torch.randn(rows, 64, generator=g)
        ours = rows_linear(x, w)
        assert ours.dtype == torch.float32 and ours.shape == (rows, 200)
        torch.testing.assert_close(ours, F.linear(x, w.float()), rtol=1e-5, atol=1e-5)


def test_a_rows_result_does_not_depend_on_its_step() -> None:
    """Each (row, output) is summed in one order whatever the rows beside it: joint and lone steps agree exactly."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(96, 128, generator=g)
    x = torch.randn(MAX_ROWS, 128, generator=g)
    together = rows_linear(x, w)
    for r in (0, 7, 8, MAX_ROWS - 1):
        assert torch.equal(rows_linear(x[r : r + 1], w)[0], together[r])


def test_attend_rows_matches_sdpa_and_writes_the_new_position() -> None:
    g = torch.Generator().manual_seed(2)
    H, Hkv, D, cap = 6, 2, 16, 40
    keys = [torch.randn(Hkv, cap, D, generator=g) for _ in range(3)]
    values = [torch.randn(Hkv, cap, D, generator=g) for _ in range(3)]
    lengths, starts = [12, 40, 1], [0, 25, 0]  # the second row as under a sliding window
    q, k, v = torch.randn(3, H, D, generator=g), torch.randn(3, Hkv, D, generator=g), torch.randn(3, Hkv, D, generator=g)
    out = _rows(q, k, v, keys, values, lengths, starts)
    for r in range(3):
        at = lengths[r] - 1
        assert torch.equal(keys[r][:, at], k[r]) and torch.equal(values[r][:, at], v[r])
        kk = keys[r][:, starts[r] : lengths[r]].repeat_interleave(H // Hkv, 0)
        vv = values[r][:, starts[r] : lengths[r]].repeat_interleave(H // Hkv, 0)
        ref = F.scaled_dot_product_attention(q[r][:, None, :][None], kk[None], vv[None])[0, :, 0, :].reshape(-1)
        torch.testing.assert_close(out[r], ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dim", [64, 128, 24])
def test_attend_rows_over_a_long_history(dim: int) -> None:
    """A history whose scores outgrow the stack buffer (the heap's), for the head sizes with their own loops and any
    other; one row alone equals it beside a short one (each (row, kv head) is summed one way)."""
    g = torch.Generator().manual_seed(4)
    H, Hkv, L = 6, 2, 6001  # 3 heads x 6001 scores: 72 KB
    keys, values = [torch.randn(Hkv, L, dim, generator=g) for _ in range(2)], [torch.randn(Hkv, L, dim, generator=g) for _ in range(2)]
    q, k, v = torch.randn(2, H, dim, generator=g), torch.randn(2, Hkv, dim, generator=g), torch.randn(2, Hkv, dim, generator=g)
    out = _rows(q, k, v, keys, values, [L, 37], [5, 0])
    kk, vv = keys[0][:, 5:L].repeat_interleave(H // Hkv, 0), values[0][:, 5:L].repeat_interleave(H // Hkv, 0)
    ref = F.scaled_dot_product_attention(q[0][:, None, :][None], kk[None], vv[None])[0, :, 0, :].reshape(-1)
    torch.testing.assert_close(out[0], ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(_rows(q[:1], k[:1], v[:1], keys[:1], values[:1], [L], [5])[0], out[0])


@pytest.mark.parametrize(
    ("n", "start", "key_start", "window", "heads", "kv_heads", "dim"),
    [
        (200, 0, 0, None, 9, 3, 64),  # a prompt's first chunk: several query and key blocks, GQA 3 (48-row items)
        (37, 0, 0, None, 4, 2, 64),  # partial blocks
        (20, 50, 0, None, 6, 2, 128),  # a later chunk over history
        (100, 30, 12, 19, 4, 1, 64),  # a sliding window, keys before key_start never read
        (5, 0, 0, 3, 2, 2, 64),  # a window shorter than the chunk
        (1, 70, 0, None, 4, 4, 16),  # one query (a kept token's) over history: one row, padded to eight
        (45, 3, 0, None, 14, 2, 36),  # GQA 7: 112-row items (vectors in threes and a two); a head size not a multiple of 8
        (9, 0, 0, None, 2, 1, 12),  # keys fewer than a 4-key tile
    ],
)
def test_attend_chunk_matches_masked_sdpa(n: int, start: int, key_start: int, window: int | None, heads: int, kv_heads: int, dim: int) -> None:
    g = torch.Generator().manual_seed(7)
    cap = start + n + 5
    keys, values = torch.randn(kv_heads, cap, dim, generator=g), torch.randn(kv_heads, cap, dim, generator=g)
    q = torch.randn(n, heads, dim, generator=g)
    out = _chunk(q, keys, values, start, key_start, window)
    at, qpos = torch.arange(key_start, start + n), torch.arange(start, start + n)
    mask = at[None] <= qpos[:, None]
    if window:
        mask &= at[None] > qpos[:, None] - window
    kk = keys[:, key_start : start + n].repeat_interleave(heads // kv_heads, 0)
    vv = values[:, key_start : start + n].repeat_interleave(heads // kv_heads, 0)
    ref = F.scaled_dot_product_attention(q.transpose(0, 1), kk, vv, attn_mask=mask).transpose(0, 1).reshape(n, heads * dim)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    wide = torch.cat((q.reshape(n, heads * dim), torch.randn(n, 2 * dim, generator=g)), dim=1)  # q as qkv's rows hold it
    assert torch.equal(_chunk(wide[:, : heads * dim].view(n, heads, dim), keys, values, start, key_start, window), out)


@pytest.mark.parametrize(
    ("n", "start", "key_start", "window", "heads", "kv_heads", "dim"),
    [
        (200, 0, 0, None, 9, 3, 64),  # a prompt's first chunk, GQA 3: 96-row items, key blocks of 32
        (37, 0, 0, None, 4, 2, 64),  # partial blocks and tiles
        (20, 50, 0, None, 6, 2, 128),  # a later chunk over history; a scale that is no power of two
        (100, 30, 12, 19, 4, 1, 64),  # a sliding window, keys before key_start never read
        (5, 0, 0, 3, 2, 2, 32),  # a window shorter than the chunk
        (45, 3, 0, None, 14, 2, 64),  # GQA 7: 224-row items
    ],
)
def test_attend_chunk_in_bf16_rounds_its_operands_only(n: int, start: int, key_start: int, window: int | None, heads: int, kv_heads: int,
                                                        dim: int) -> None:
    """Where AMX runs, a prompt chunk of a model whose projections multiply in bf16 attends in bf16 (attend_bf16.c):
    q * scale and the keys rounded for the scores, the softmax's weights and the values for their product, sums in
    f32. Against the exact attention of the rounded q, keys and values, only the weights' rounding remains (<= 2^-9
    of each, so <= 2^-9 max |v| per output). A query's bits do not depend on the chunk it came in (cut anywhere, or
    alone), the threads, or whether the cache holds the values as f16."""
    g = torch.Generator().manual_seed(8)
    cap = start + n + 40  # room past the chunk: keys there are never read (NaN here)
    keys, values = torch.randn(kv_heads, cap, dim, generator=g), torch.randn(kv_heads, cap, dim, generator=g) * 3
    keys[:, start + n :], values[:, start + n :] = float("nan"), float("nan")
    q = torch.randn(n, heads, dim, generator=g) * 2
    if not bf16_attention(dim):
        assert bf16_units() != "amx"
        with pytest.raises(ValueError, match="AMX"):
            _chunk(q, keys, values, start, key_start, window, bf16=True)
        pytest.skip(f"no AMX tiles here (bf16 units: {bf16_units()})")
    out = _chunk(q, keys, values, start, key_start, window, bf16=True)
    at, qpos = torch.arange(key_start, start + n), torch.arange(start, start + n)
    mask = at[None] <= qpos[:, None]
    if window:
        mask &= at[None] > qpos[:, None] - window
    r = lambda t: t.bfloat16().double()
    kk = r(keys[:, key_start : start + n]).repeat_interleave(heads // kv_heads, 0)
    vv = r(values[:, key_start : start + n]).repeat_interleave(heads // kv_heads, 0)
    scores = (r(q * dim**-0.5).transpose(0, 1) @ kk.transpose(1, 2)).masked_fill(~mask, float("-inf"))
    ref = (scores.softmax(-1) @ vv).transpose(0, 1).reshape(n, heads * dim)
    assert (out.double() - ref).abs().max() <= 2**-9 * values[:, : start + n].abs().max() * 1.01
    assert not torch.equal(out, _chunk(q, keys, values, start, key_start, window))  # it did round
    for cut in {1, n // 2, n - 1} - {0, n}:
        parts = [_chunk(q[:cut], keys, values, start, key_start, window, bf16=True),
                 _chunk(q[cut:], keys, values, start + cut, key_start, window, bf16=True)]
        assert torch.equal(torch.cat(parts), out)
    for i in {0, n // 3, n - 1}:
        assert torch.equal(_chunk(q[i : i + 1], keys, values, start + i, key_start, window, bf16=True), out[i : i + 1])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert torch.equal(_chunk(q, keys, values, start, key_start, window, bf16=True), out)
    finally:
        torch.set_num_threads(threads)
    k16, v16 = keys.half(), values.half()
    assert torch.equal(_chunk(q, k16, v16, start, key_start, window, bf16=True), _chunk(q, k16.float(), v16.float(), start, key_start, window, bf16=True))


@pytest.mark.parametrize("rows", [1, MAX_ROWS, 300])
def test_rms_norm_rows_matches_torch(rows: int) -> None:
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(rows, 72, generator=g), torch.randn(72, generator=g)
    torch.testing.assert_close(rms_norm_rows(x, w, 1e-5), F.rms_norm(x, (72,), w, 1e-5), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("rows", [1, 5, 70])
def test_norms_in_place_and_onto_a_residual_are_rms_norm_rows_bits(rows: int) -> None:
    """q/k norms in place in a qkv product's rows (rms_norm_heads), and residual + norm in one pass
    (rms_norm_add_rows): the bits rms_norm_rows gives, nothing outside the heads touched."""
    g = torch.Generator().manual_seed(8)
    qkv = torch.randn(rows, 7 * 32, generator=g) * 3  # 4 q heads, 1 k head, 2 v heads of 32
    wq, wk = torch.randn(32, generator=g), torch.randn(32, generator=g)
    want_q = rms_norm_rows(qkv[:, :128].reshape(-1, 32), wq, 1e-6).view(rows, 128)
    want_k = rms_norm_rows(qkv[:, 128:160].contiguous(), wk, 1e-6)
    rest = qkv[:, 160:].clone()
    qk = qkv[:, :160].view(rows, 5, 32)
    rms_norm_heads(qk[:, :4], wq, 1e-6)
    rms_norm_heads(qk[:, 4:], wk, 1e-6)
    assert torch.equal(qkv[:, :128], want_q) and torch.equal(qkv[:, 128:160], want_k) and torch.equal(qkv[:, 160:], rest)
    x, res, w = torch.randn(rows, 72, generator=g), torch.randn(rows, 72, generator=g), torch.randn(72, generator=g)
    want = res + rms_norm_rows(x, w, 1e-5)
    assert torch.equal(rms_norm_add_rows(x, w, 1e-5, res), want) and torch.equal(x, want)  # written over x


@pytest.mark.parametrize("gate", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("rows", [1, 5, 300])
def test_gated_rows_match_torch(rows: int, gate: str) -> None:
    """Ordinary values, and gates where e^-g (silu) or e^-2z (gelu) under- or overflows (act(g) is then g, or 0)."""
    g = torch.Generator().manual_seed(6)
    gate_up = torch.randn(rows, 2 * 40, generator=g) * 4
    gate_up[0, :16] = torch.tensor([-200.0, -88.5, -87.0, -20.0, 0.0, 20.0, 88.5, 200.0, -1e20, -9.0, -5.0, -0.5, 0.5, 5.0, 9.0, 1e20])
    gate_up[0, 40:56] = torch.tensor([1.0] * 8 + [1e-10, 1, 1, 1, 1, 1, 1, 1e-10])  # an up that keeps act(+-1e20) * up finite
    up = gate_up[:, 40:]
    act = F.silu(gate_up[:, :40]) if gate == "silu" else F.gelu(gate_up[:, :40], approximate="tanh")
    # GELU's tail: torch's tanh reaches -1 (a zero) where e^-2z still gives a few 1e-7 (torch's is the less exact)
    torch.testing.assert_close(gated_rows(gate_up, gate), act * up, rtol=2e-6, atol=1e-6 if gate == "silu" else 3e-6)


@pytest.mark.parametrize(("out", "width"), [(48, 64), (200, 300), (7, 5), (24, 520)])
def test_panel_linear_matches_torch_for_any_rows(out: int, width: int) -> None:
    """Full and narrow last panels (200 = 8 x 24 + 8; 7 < 24), K across the 256-wide blocks and not a multiple of 8,
    and row counts from one to more than one packed block (144) on each thread."""
    g = torch.Generator().manual_seed(4)
    w = torch.randn(out, width, generator=g)
    ref_w = w.clone()
    packed = pack_panels(w)
    assert packed.data_ptr() == w.data_ptr()  # in place: a block keeps no second copy
    for rows in (1, 2, 3, 4, 5, 31, 33, 300):
        x = torch.randn(rows, width, generator=g)
        torch.testing.assert_close(panel_linear(x, packed), F.linear(x, ref_w), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rows", [1, 3, 5, 300])
def test_panel_linear_folds_the_norm_and_the_gate_bit_for_bit(rows: int) -> None:
    """RMSNorm and act(gate) * up (silu, gelu) made while packing give exactly the separate kernels' product (K = 264: two
    256-wide blocks; rows 1-5 split the panels, 300 the rows; a residual beside), and match torch."""
    g = torch.Generator().manual_seed(9)
    w = torch.randn(50, 264, generator=g)
    ref_w, packed = w.clone(), pack_panels(w)
    x, nw, res = torch.randn(rows, 264, generator=g), torch.randn(264, generator=g), torch.randn(rows, 50, generator=g)
    folded = panel_linear(x, packed, res, norm=(nw, 1e-6))
    assert torch.equal(folded, panel_linear(rms_norm_rows(x, nw, 1e-6), packed, res))
    torch.testing.assert_close(folded, res + F.linear(F.rms_norm(x, (264,), nw, 1e-6), ref_w), rtol=1e-5, atol=1e-4)
    gate_up = torch.randn(rows, 2 * 264, generator=g) * 3
    for gate, act in (("silu", F.silu), ("gelu_tanh", lambda t: F.gelu(t, approximate="tanh"))):
        folded = panel_linear(gate_up, packed, gated=gate)
        assert torch.equal(folded, panel_linear(gated_rows(gate_up, gate), packed))
        torch.testing.assert_close(folded, F.linear(act(gate_up[:, :264]) * gate_up[:, 264:], ref_w), rtol=1e-5, atol=1e-4)
    assert torch.equal(panel_linear(gate_up, packed, gated=True), panel_linear(gate_up, packed, gated="silu"))


def test_a_rows_panel_result_does_not_depend_on_its_step() -> None:
    """A decode step's row and a prompt's row are summed alike: one row alone equals that row among 300 (which the
    threads split by rows, where a few rows split the panels), bit for bit."""
    g = torch.Generator().manual_seed(5)
    w = pack_panels(torch.randn(120, 600, generator=g))
    x = torch.randn(300, 600, generator=g)
    together = panel_linear(x, w)
    for r in (0, 5, 143, 144, 299):
        assert torch.equal(panel_linear(x[r : r + 1], w)[0], together[r])
        assert torch.equal(panel_linear(x[r : r + 3], w)[0], together[r])


def test_rope_rows_in_place_matches_rotate_half() -> None:
    """In place on q and k heads that are a view into wider rows (qkv), v left alone."""
    from jitllmd.engine.layers.rope import rotate

    g = torch.Generator().manual_seed(8)
    T, H, Hkv, D = 40, 3, 1, 32
    qkv = torch.randn(T, (H + 2 * Hkv) * D, generator=g)
    angles = torch.randn(T, 1, D // 2, generator=g)
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    sin = torch.cat((-sin[..., : D // 2], sin[..., D // 2 :]), dim=-1)
    qk = qkv[:, : (H + Hkv) * D].view(T, H + Hkv, D)
    want, v = rotate(qk.clone(), cos, sin), qkv[:, (H + Hkv) * D :].clone()
    rope_rows(qk, cos, sin)
    torch.testing.assert_close(qkv[:, : (H + Hkv) * D].view(T, H + Hkv, D), want, rtol=1e-6, atol=1e-6)
    assert torch.equal(qkv[:, (H + Hkv) * D :], v)


def test_panel_linear_adds_a_residual() -> None:
    g = torch.Generator().manual_seed(9)
    w = torch.randn(72, 300, generator=g)
    packed = pack_panels(w.clone())
    for rows in (1, 6, 200):
        x, r = torch.randn(rows, 300, generator=g), torch.randn(rows, 72, generator=g)
        torch.testing.assert_close(panel_linear(x, packed, r), r + F.linear(x, w), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("variant", variants())
def test_top_k_is_torch_topk_with_the_lower_id_first_among_equals(variant: str) -> None:
    """The sampler's candidates: the k largest in torch.topk's order, on every variant; equal values keep id order
    (torch leaves their order open: logits rounded to a few values tie often), -inf counts as a value, NaN does not."""
    use_variant(variant)
    try:
        g = torch.Generator().manual_seed(5)
        for n, k in ((5, 1), (7, 7), (49152, 40), (49152, 1), (1000, 999), (33, 20)):
            x = torch.randn(n, generator=g) * 3
            values, ids = top_k(x, k)
            want = torch.topk(x, k)
            assert torch.equal(values, want.values) and torch.equal(ids, want.indices), (n, k)
        x = torch.randint(0, 6, (4000,), generator=g).float()  # ties everywhere: among equals, the lower id
        values, ids = top_k(x, 50)
        order = sorted(range(4000), key=lambda i: (-x[i].item(), i))[:50]
        assert ids.tolist() == order and torch.equal(values, x[ids])
        x = torch.full((300,), float("-inf"))
        x[[7, 200]] = torch.tensor([1.0, 2.0])
        assert top_k(x, 4)[1].tolist() == [200, 7, 0, 1]  # grammar-masked logits: the allowed first, then -inf in id order
        x[[3, 250]] = float("nan")
        values, ids = top_k(x, 4)
        assert ids.tolist() == [200, 7, 0, 1] and not values.isnan().any()
        assert top_k(torch.full((10,), float("nan")), 3)[0].numel() == 0  # no numbers: none found
    finally:
        use_variant(None)


def test_describe_names_the_variant_and_its_build() -> None:
    """The best variant this CPU runs, by default; a forced one names itself."""
    assert describe().startswith(f"{variants()[-1]} (kernels-") and describe().endswith(".so)")
    use_variant("avx2+fma")
    try:
        assert describe().startswith("avx2+fma (kernels-")
    finally:
        use_variant(None)


def test_run_keeps_its_kernel_build_under_jitllmd_cache(tiny_serve_jlm: Path, tmp_path: Path) -> None:
    """`jitllmd run` passes $JITLLMD_CACHE/kernels to the engine (which reads no environment itself)."""
    env = {**os.environ, "JITLLMD_CACHE": str(tmp_path)}
    cmd = [sys.executable, "-m", "jitllmd", "run", "-model", str(tiny_serve_jlm), "-n", "2", "-temp", "0", "-json", "hi"]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr
    builds = [f.name for f in (tmp_path / "kernels").glob("kernels-*.so")]
    assert len(builds) == 1 and f"({builds[0]})" in describe()  # the same sources: the same build as this process's
