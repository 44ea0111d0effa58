"""quant.c against gguf's own numpy dequantization: every type, on every kernel variant this CPU runs; where builds are kept."""

from __future__ import annotations

import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType, quants

from jitllmd.engine.kernels import build, describe, ops, rows_kernel, use_variant, variants
from jitllmd.engine.kernels.ops import dequant_rows, quant_rows
from jitllmd.engine.layers.formats import BY_GGML, to_lanes

pytestmark = pytest.mark.skipif(rows_kernel() is None, reason="no C compiler or no AVX2/FMA/F16C here: the engine runs torch's ops")

N = 37  # output rows: not a multiple of 8 (a row group) nor of 2 or 3 (threads)
BLOCKS = {2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34), 12: (256, 144), 13: (256, 176), 14: (256, 210)}


@pytest.fixture(params=variants())
def variant(request: pytest.FixtureRequest) -> Iterator[str]:
    use_variant(request.param)
    yield request.param
    use_variant(None)


def quantized(qtype: int, n: int, k: int, seed: int) -> np.ndarray:
    """n rows of k weights as qtype's bytes [n, row bytes]: gguf's quantizer for the 32-formats; random bytes with
    sane f16 scales (0.01 .. 0.1) for the K-formats, which gguf cannot quantize."""
    rng = np.random.default_rng(seed)
    if qtype < 12:
        return quants.quantize(rng.standard_normal((n, k)).astype(np.float32), GGMLQuantizationType(qtype))
    elems, nbytes = BLOCKS[qtype]
    raw = rng.integers(0, 256, (n, k // elems, nbytes), dtype=np.uint8)
    scales = rng.uniform(0.01, 0.1, (n, k // elems, 2)).astype(np.float16).view(np.uint8)  # [n, blocks, 4]: d, dmin
    if qtype == 14:
        raw[..., 208:210] = scales[..., :2]  # Q6_K: d last
    else:
        raw[..., 0:4] = scales  # Q4_K, Q5_K: d, dmin first
    return raw.reshape(n, -1)


TAIL_BLOCKS = (1, 2, 4, 13, 15, 18, 20)  # a row's last group of 1, 2, 4, 5, 7, 2, 4 blocks


def width(qtype: int) -> int:
    return 352 if qtype < 12 else 512  # 11 blocks (a group of 8 and a short one); 2 superblocks


def reference(wb: np.ndarray, qtype: int) -> torch.Tensor:
    return torch.from_numpy(quants.dequantize(wb, GGMLQuantizationType(qtype)))


def held(wb: np.ndarray, qtype: int) -> torch.Tensor:
    """Ggml's blocks wb as the engine holds them (a .jlm's order: K-formats' codes in lane order)."""
    fmt = BY_GGML[qtype]
    return to_lanes(torch.from_numpy(wb).reshape(-1, fmt.nbytes), fmt).reshape(wb.shape)


@pytest.mark.parametrize("qtype", BY_GGML)
def test_dequant_rows_is_gguf_bit_for_bit(variant: str, qtype: int) -> None:
    wb = quantized(qtype, N, width(qtype), qtype)
    ref, w = reference(wb, qtype), held(wb, qtype)
    got = dequant_rows(w, qtype, N, width(qtype))
    assert got.dtype == torch.float32 and torch.equal(got.view(torch.int32), ref.view(torch.int32))
    bf = dequant_rows(w.reshape(-1), qtype, N, width(qtype), out=torch.empty(N, width(qtype), dtype=torch.bfloat16))
    assert torch.equal(bf.view(torch.int16), ref.to(torch.bfloat16).view(torch.int16))
    ids = torch.tensor([N - 1, 0, 3, 3])  # a lookup's rows, gathered as they are read: repeats, any order
    assert torch.equal(dequant_rows(w, qtype, N, width(qtype), ids=ids).view(torch.int32), ref[ids].view(torch.int32))
    with pytest.raises(IndexError, match="row ids"):
        dequant_rows(w, qtype, N, width(qtype), ids=torch.tensor([N]))


def f32_sums(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """What f32 sums may add to the error: a few ulps of each 32-block's magnitude, taken as its largest |w| over all
    its inputs (for the offset formats a block's partial sums run up to d_w * q_max * sum |x|)."""
    block_max = w.abs().reshape(w.shape[0], -1, 32).amax(-1).repeat_interleave(32, 1)  # [N, K]
    return 1e-5 * (x.abs() @ block_max.T) + 1e-6


def bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """quant.c's bound on |quant_rows - x @ w.T|: sum_k |w_ok| d(t, k) / 2, d x's int8 step per 32 inputs, plus f32 sums."""
    rows, k = x.shape
    step = (x.abs().reshape(rows, k // 32, 32).amax(-1) / 127).repeat_interleave(32, 1)  # [T, K]
    return (step / 2) @ w.abs().T * (1 + 1e-5) + f32_sums(x, w)


def on_int8_grid(x: torch.Tensor) -> torch.Tensor:
    """x as quant.c rounds it: per 32 inputs d = amax / 127, q = round-half-even(x * (1 / d)), d * q (in f64)."""
    blocks = x.reshape(x.shape[0], -1, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    q = torch.round(blocks * torch.where(d != 0, 1 / d, 0))
    return (d.double() * q.double()).reshape(x.shape)


@pytest.mark.parametrize("qtype", BY_GGML)
def test_quant_rows_within_its_bound_and_row_independent(variant: str, qtype: int) -> None:
    """Steps of 1 .. 17 rows (groups of 8 and their remainders), a zero row, the out= column-slice form, and each row's
    result the same alone, among others, and on one thread."""
    k = width(qtype)
    wb = quantized(qtype, N, k, 100 + qtype)
    ref, w = reference(wb, qtype), held(wb, qtype)
    g = torch.Generator().manual_seed(qtype)
    for rows in (1, 3, 8, 9, 16, 17):
        x = torch.randn(rows, k, generator=g) * torch.rand(rows, 1, generator=g) * 3
        if rows > 2:
            x[2] = 0
        y = quant_rows(x, w, qtype, N)
        assert y.dtype == torch.float32 and y.shape == (rows, N)
        err = (y - F.linear(x, ref)).abs()
        assert (err <= bound(x, ref)).all(), (err - bound(x, ref)).max()
        exact = on_int8_grid(x) @ ref.double().T  # the same x codes, summed exactly: only f32 sums differ
        assert ((y - exact).abs() <= f32_sums(x, ref)).all()
        if rows > 2:
            assert not y[2].any()
        for r in (0, rows - 1):
            assert torch.equal(quant_rows(x[r : r + 1], w, qtype, N)[0], y[r])
        wide = torch.full((rows, N + 7), float("nan"))
        assert quant_rows(x.bfloat16(), w, qtype, N, out=wide[:, 3 : 3 + N]).data_ptr() == wide[:, 3:].data_ptr()
        assert torch.equal(wide[:, 3 : 3 + N], quant_rows(x.bfloat16(), w, qtype, N)) and wide[:, :3].isnan().all() and wide[:, 3 + N :].isnan().all()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert torch.equal(quant_rows(x, w, qtype, N), y)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("qtype", [q for q in BY_GGML if q < 12])
def test_a_short_last_group_of_any_length(variant: str, qtype: int) -> None:
    """A 32-format row's short last group (1 .. 7 blocks: packed into 2 or 4 vectors up to 4 blocks) gives the exact
    integer sums within f32 steps, a row's result the same alone, as the other rows beside it, whatever the rows."""
    g = torch.Generator().manual_seed(qtype)
    for blocks in TAIL_BLOCKS:
        k = 32 * blocks
        wb = quantized(qtype, N, k, 7 * blocks + qtype)
        ref, w = reference(wb, qtype), held(wb, qtype)
        x = torch.randn(17, k, generator=g) * torch.rand(17, 1, generator=g) * 3
        y = quant_rows(x, w, qtype, N)
        exact = on_int8_grid(x) @ ref.double().T
        assert ((y - exact).abs() <= f32_sums(x, ref)).all(), blocks
        for rows in (1, 2, 9):
            assert torch.equal(quant_rows(x[:rows], w, qtype, N), y[:rows]), blocks
        assert torch.equal(quant_rows(x[16:], w, qtype, N)[0], y[16]), blocks


CODES_AT = {2: 2, 3: 4, 6: 2, 7: 4, 8: 2, 12: 4, 13: 4, 14: 0}  # where a block's bytes after its f16 scales start (Q6_K: d is last)


def extreme(qtype: int, n: int, k: int, seed: int) -> np.ndarray:
    """quantized()'s blocks with every byte after the f16 scales (Q6_K: before d) one of 0x00, 0xff, 0x80, 0x7f, one
    value a whole block: the codes at the ends of their range (Q8_0's -128 and 127, Q6_K's q - 32 all -32 or 31, the
    K-formats' 6-bit scales at 63) and runs of them as long as a block, for the integer sums' largest magnitudes."""
    elems, nbytes = BLOCKS[qtype]
    raw = quantized(qtype, n, k, seed).reshape(n, k // elems, nbytes)
    fill = np.random.default_rng(seed).choice(np.array([0x00, 0xFF, 0x80, 0x7F], np.uint8), (n, k // elems, 1))
    end = 208 if qtype == 14 else nbytes
    raw[..., CODES_AT[qtype] : end] = fill
    return raw.reshape(n, -1)


@pytest.mark.parametrize("qtype", BY_GGML)
def test_the_integer_sums_hold_at_the_codes_extremes(variant: str, qtype: int) -> None:
    """Weights at their codes' extremes against x of +-1 (codes +-127), a sign a 32-block, so that each lane's products
    all add one way: quant_rows (one row and row groups) and the GEMM still give the exact sums of the codes within
    f32 steps (an int16 sum that saturated or wrapped would be off by thousands of steps)."""
    k = 1024
    wb = extreme(qtype, N, k, 800 + qtype)
    ref, w = reference(wb, qtype), held(wb, qtype)
    g = torch.Generator().manual_seed(900 + qtype)
    for rows in (1, 3, 16):
        x = (torch.randint(0, 2, (rows, k // 32, 1), generator=g) * 2.0 - 1).expand(rows, k // 32, 32).reshape(rows, k).contiguous()
        x[-1] = 1.0  # one row of a single sign throughout
        exact = on_int8_grid(x) @ ref.double().T
        for y in (quant_rows(x, w, qtype, N), ops.gemm_runs(x, [(w, qtype, N)], N)):
            assert ((y - exact).abs() <= f32_sums(x, ref)).all(), (rows, (y - exact).abs().max())


@pytest.mark.parametrize("qtype", [8, 12, 6, 14])  # Q8_0, Q4_K, Q5_0, Q6_K
def test_quant_rows_folds_norm_and_gate_bit_for_bit(variant: str, qtype: int) -> None:
    """With `norm` the rows quantized are rms_norm_rows's, with `gated` gated_rows's (silu, gelu), to the bit: the fused call
    equals the two-call composition, for any number of rows and into a column slice of a wider output."""
    k = width(qtype)
    w = torch.from_numpy(quantized(qtype, N, k, 200 + qtype))
    g = torch.Generator().manual_seed(300 + qtype)
    nw = torch.rand(k, generator=g) + 0.5
    for rows in (1, 8, 17):
        x = torch.randn(rows, k, generator=g) * 3
        gate_up = torch.randn(rows, 2 * k, generator=g) * 4
        x[-1], gate_up[-1] = 0, 0  # a zero row: scale 1 / sqrt(eps), and silu(0) = 0
        cases = [
            (x, {"norm": (nw, 1e-6)}, ops.rms_norm_rows(x, nw, 1e-6)),
            (gate_up, {"gated": True}, ops.gated_rows(gate_up)),
            (gate_up, {"gated": "gelu_tanh"}, ops.gated_rows(gate_up, "gelu_tanh")),
        ]
        for src, fold, made in cases:
            want = quant_rows(made, w, qtype, N)
            assert torch.equal(quant_rows(src, w, qtype, N, **fold).view(torch.int32), want.view(torch.int32))
            wide = torch.full((rows, N + 5), float("nan"))
            quant_rows(src, w, qtype, N, out=wide[:, 2 : 2 + N], **fold)
            assert torch.equal(wide[:, 2 : 2 + N].view(torch.int32), want.view(torch.int32))
            assert wide[:, :2].isnan().all() and wide[:, 2 + N :].isnan().all()
    with pytest.raises(AssertionError):
        quant_rows(x, w, qtype, N, norm=(nw, 1e-6), gated=True)


@pytest.mark.parametrize("qtype", [8, 2, 12, 14])  # Q8_0, Q4_0, Q4_K, Q6_K
def test_quant_rows_adds_a_residual_or_bias_as_torch_would(variant: str, qtype: int) -> None:
    """`add` (a residual [T, n] or a bias [n]) is added in the kernel's sums: bit for bit `add + product`, into a
    column slice too, and across runs of rows (quant_runs) each run's columns of it."""
    k = width(qtype)
    w = torch.from_numpy(quantized(qtype, N, k, 400 + qtype))
    g = torch.Generator().manual_seed(500 + qtype)
    for rows in (1, 9):
        x = torch.randn(rows, k, generator=g)
        product = quant_rows(x, w, qtype, N)
        for add in (torch.randn(rows, N, generator=g) * 5, torch.randn(N, generator=g)):
            want = (add + product).view(torch.int32)
            assert torch.equal(quant_rows(x, w, qtype, N, add=add).view(torch.int32), want)
            wide = torch.full((rows, N + 4), float("nan"))
            quant_rows(x, w, qtype, N, out=wide[:, 1 : 1 + N], add=add)
            assert torch.equal(wide[:, 1 : 1 + N].view(torch.int32), want) and wide[:, 0].isnan().all()
        # two runs: the first 12 rows and the rest, stacked along the output
        runs = [(w[:12], qtype, 12), (w[12:], qtype, N - 12)]
        add = torch.randn(rows, N, generator=g)
        assert torch.equal(ops.quant_runs(x, runs, N, add=add).view(torch.int32), (add + product).view(torch.int32))


@pytest.mark.parametrize("qtype", [8, 12])
def test_a_projection_writes_a_steps_rows_in_place_with_the_bits_it_returns(variant: str, qtype: int) -> None:
    """QuantLinear into `out` (a slice of a step's output, as the MLP's row blocks are): a prompt chunk's rows, and a
    step that mixes them with decode rows on either side, with the residual added in the kernels' sums: the same bits
    as returned anew and added after, written in `out` itself (no copy after the kernels)."""
    from jitllmd.engine.layers.quant import QuantLinear, Segment

    k = width(qtype)
    w = torch.from_numpy(quantized(qtype, N, k, 600 + qtype))
    lin = QuantLinear(w, [Segment(BY_GGML[qtype], N, k)], None)
    g = torch.Generator().manual_seed(700 + qtype)
    T = 11
    x, residual = torch.randn(T, k, generator=g), torch.randn(T, N, generator=g)
    for chunk in (torch.ones(T, dtype=torch.bool), torch.tensor([False, False] + [True] * 7 + [False, False]),
                  torch.tensor([True, False] * 5 + [True])):
        for res in (None, residual):
            long, short = chunk.nonzero().squeeze(1), (~chunk).nonzero().squeeze(1)
            want = torch.empty(T, N)
            want[long] = lin._run(x[long], True)
            if short.numel():
                want[short] = lin._run(x[short], False)
            if res is not None:
                want = res + want
            wide = torch.full((T + 2, N), float("nan"))
            out = wide[1 : 1 + T]
            got = lin(x, res, chunk=chunk, out=out)
            assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (chunk.tolist(), res is None)
            assert got.data_ptr() == out.data_ptr() and wide[0].isnan().all() and wide[-1].isnan().all()


@pytest.mark.parametrize("qtype", BY_GGML)
def test_gemm_rows_within_the_decode_bound_and_row_independent(variant: str, qtype: int) -> None:
    """The int8 GEMM (prompt chunks without bf16 units): x's codes as quant_rows makes them, so the same bound against
    x @ W.T and only f32 sums off the exact sum of those codes; tiles of 4 rows (3 over a pair of panels) and their
    remainders (1 .. 13 rows), panels of 8 weight rows (or pairs of them) and N's remainder, a zero row; each row's result the bits it has alone, on one thread,
    with the norm or gate folded in, with a residual or bias added, across runs of rows."""
    k = width(qtype)
    wb = quantized(qtype, N, k, 600 + qtype)
    ref, w = reference(wb, qtype), held(wb, qtype)
    g = torch.Generator().manual_seed(700 + qtype)
    for rows in (1, 2, 3, 4, 5, 13):
        x = torch.randn(rows, k, generator=g) * torch.rand(rows, 1, generator=g) * 3
        if rows > 2:
            x[2] = 0
        y = ops.gemm_runs(x, [(w, qtype, N)], N)
        assert y.dtype == torch.float32 and y.shape == (rows, N)
        err = (y - F.linear(x, ref)).abs()
        assert (err <= bound(x, ref)).all(), (err - bound(x, ref)).max()
        assert ((y - on_int8_grid(x) @ ref.double().T).abs() <= f32_sums(x, ref)).all()
        assert ((y - quant_rows(x, w, qtype, N)).abs() <= 2 * f32_sums(x, ref)).all()  # the same codes, another f32 order
        if rows > 2:
            assert not y[2].any()
        for r in range(rows):
            assert torch.equal(ops.gemm_runs(x[r : r + 1], [(w, qtype, N)], N)[0], y[r])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert torch.equal(ops.gemm_runs(x, [(w, qtype, N)], N), y)
    finally:
        torch.set_num_threads(threads)
    nw = torch.rand(k, generator=g) + 0.5
    gate_up = torch.randn(13, 2 * k, generator=g) * 4
    for src, fold, made in ((x, {"norm": (nw, 1e-6)}, ops.rms_norm_rows(x, nw, 1e-6)), (gate_up, {"gated": True}, ops.gated_rows(gate_up)),
                            (gate_up, {"gated": "gelu_tanh"}, ops.gated_rows(gate_up, "gelu_tanh"))):
        assert torch.equal(ops.gemm_runs(src, [(w, qtype, N)], N, **fold).view(torch.int32), ops.gemm_runs(made, [(w, qtype, N)], N).view(torch.int32))
    product = ops.gemm_runs(x, [(w, qtype, N)], N)
    for add in (torch.randn(13, N, generator=g) * 5, torch.randn(N, generator=g)):
        assert torch.equal(ops.gemm_runs(x, [(w, qtype, N)], N, add=add).view(torch.int32), (add + product).view(torch.int32))
        assert torch.equal(ops.gemm_runs(x, [(w[:12], qtype, 12), (w[12:], qtype, N - 12)], N, add=add).view(torch.int32),
                           (add + product).view(torch.int32))


BF16_VARIANTS = {"avx512+bf16": "avx512_bf16", "avx512+amx": "amx"}  # variant -> the units bf16_rows runs on


@pytest.mark.parametrize("qtype", BY_GGML)
def test_bf16_rows_round_x_and_w_to_bf16_only(variant: str, qtype: int) -> None:
    """A prompt chunk's product on variants with bf16 units: x and the dequantized W rounded to bf16 (nearest even),
    the products summed in f32 (only their order differs from an exact sum); each row's result the same alone and
    among any number of others (1 .. 70 rows: partial tiles of 16 and 32), on one thread or two, and `add` added as
    torch would. N = 37 rows: a whole panel of 32 and a ragged one."""
    if variant not in BF16_VARIANTS:
        assert ops.bf16_units() is None
        pytest.skip(f"{variant} has no bf16 units")
    units = BF16_VARIANTS[variant]
    if units == "amx" and ops.bf16_units() != "amx":
        pytest.skip("the OS does not grant this process AMX tile state")
    assert ops.bf16_units() == units
    k = width(qtype)
    wb = quantized(qtype, N, k, 600 + qtype)
    ref, w = reference(wb, qtype), held(wb, qtype)
    runs = [(w, qtype, N)]
    g = torch.Generator().manual_seed(700 + qtype)
    x = torch.randn(70, k, generator=g) * torch.rand(70, 1, generator=g) * 3
    x[5] = 0
    exact = x.bfloat16().double() @ ref.bfloat16().double().T
    sums = (x.bfloat16().double().abs() @ ref.bfloat16().double().abs().T) * 2**-20  # f32 sums of k <= 512 products: well within
    whole = ops.bf16_runs(x, runs, N)
    assert whole.dtype == torch.float32 and whole.shape == (70, N)
    assert ((whole - exact).abs() <= sums).all() and not whole[5].any()
    assert not torch.equal(whole, (x.double() @ ref.double().T).float())  # it did round
    for rows in (1, 3, 16, 17, 33):
        assert torch.equal(ops.bf16_runs(x[:rows], runs, N), whole[:rows])
        assert torch.equal(ops.bf16_runs(x[-rows:], runs, N), whole[-rows:])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert torch.equal(ops.bf16_runs(x, runs, N), whole)
    finally:
        torch.set_num_threads(threads)
    split = [(w[:12], qtype, 12), (w[12:], qtype, N - 12)]  # two runs stacked along the output
    for add in (torch.randn(70, N, generator=g) * 5, torch.randn(N, generator=g)):
        assert torch.equal(ops.bf16_runs(x, split, N, add=add).view(torch.int32), (add + whole).view(torch.int32))
    # the norm or the gate made as the rows are rounded: the bits of the rows made first
    nw, gate_up = torch.rand(k, generator=g) + 0.5, torch.randn(70, 2 * k, generator=g) * 4
    for src, fold, made in ((x, {"norm": (nw, 1e-6)}, ops.rms_norm_rows(x, nw, 1e-6)), (gate_up, {"gated": True}, ops.gated_rows(gate_up)),
                            (gate_up, {"gated": "gelu_tanh"}, ops.gated_rows(gate_up, "gelu_tanh"))):
        assert torch.equal(ops.bf16_runs(src, runs, N, **fold).view(torch.int32), ops.bf16_runs(made, runs, N).view(torch.int32))
        # rounded once (bf16_round) for several products: 70 rows padded to 96 with zeros, the same products
        xb = ops.bf16_round(src, **fold)
        assert xb.rows == 70 and xb.data.shape == (96, k) and torch.equal(xb.data[:70], made.bfloat16()) and not xb.data[70:].any()
        assert torch.equal(ops.bf16_runs(xb, split, N), ops.bf16_runs(made, runs, N))


def test_the_variants_agree_bit_for_bit() -> None:
    """Integer sums are exact and the f32 steps the same on every variant (maddubs or dpbusd): decode rows' results and
    the int8 GEMM's are identical."""
    results = []
    for v in variants():
        use_variant(v)
        try:
            out = []
            for qtype in BY_GGML:
                wb = torch.from_numpy(quantized(qtype, N, width(qtype), qtype))
                g = torch.Generator().manual_seed(qtype)
                out.append(quant_rows(torch.randn(5, width(qtype), generator=g), wb, qtype, N))
                out.append(quant_rows(torch.randn(5, width(qtype), generator=g), wb, qtype, N, norm=(torch.rand(width(qtype), generator=g), 1e-6)))
                out.append(quant_rows(torch.randn(5, 2 * width(qtype), generator=g) * 4, wb, qtype, N, gated=True))
                out.append(quant_rows(torch.randn(5, 2 * width(qtype), generator=g) * 4, wb, qtype, N, gated="gelu_tanh"))
                out.append(ops.gemm_runs(torch.randn(7, width(qtype), generator=g), [(wb, qtype, N)], N))  # the prompt chunks' GEMM too
                if qtype < 12:  # every length of a short last group
                    for blocks in TAIL_BLOCKS:
                        wt = torch.from_numpy(quantized(qtype, N, 32 * blocks, blocks))
                        out.append(quant_rows(torch.randn(5, 32 * blocks, generator=g), wt, qtype, N))
            results.append(out)
        finally:
            use_variant(None)
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other))


def test_describe_names_the_variant_in_use(variant: str) -> None:
    slug = re.sub(r"[^a-z0-9]+", "-", variant)
    assert re.fullmatch(rf"{re.escape(variant)} \(kernels-{slug}-[0-9a-f]{{12}}\.so\)", describe())


def test_a_build_replaces_only_its_own_variants_older_builds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each variant keeps its build as kernels-<slug>-<hash>.so (a tiny source here, to build fast); a new build
    removes that variant's older ones and no other's."""
    source = tmp_path / "tiny.c"
    source.write_text("int tiny(void) { return 1; }\n")
    monkeypatch.setattr(build, "_SOURCES", [source])
    monkeypatch.setattr(build, "_HEADERS", [])
    cache = tmp_path / "cache"
    cache.mkdir()
    slugs = {v: re.sub(r"[^a-z0-9]+", "-", v) for v in variants()}
    stale = [cache / f"kernels-{slug}-000000000000.so" for slug in slugs.values()]
    for path in [*stale, cache / "kernels-other-000000000000.so"]:
        path.write_bytes(b"")
    compiler = shutil.which("cc") or shutil.which("gcc")
    assert compiler is not None
    built = {v: build._build(cache, compiler, v) for v in variants()[:-1]}
    assert all(re.fullmatch(rf"kernels-{slugs[v]}-[0-9a-f]{{12}}\.so", p.name) for v, p in built.items())
    assert not any(p.exists() for p in stale[:-1]) and stale[-1].exists() and (cache / "kernels-other-000000000000.so").exists()
    assert build._build(cache, compiler, variants()[-1]).exists() and not stale[-1].exists()
    assert all(p.exists() and build._build(cache, compiler, v) == p for v, p in built.items())  # kept, and found again
