"""Quantized weights: the block formats against gguf's own reference, the quantizers, and tiny models kept quantized
against the same weights dequantized to f32 (prompt at once, token by token, packed rows), on every kernel path."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from jitllmd.engine import kernels
from jitllmd.engine.convert import ConvertError, convert
from jitllmd.engine.jlm import JLMError, JLMFile, TensorSpec, write_jlm
from jitllmd.engine.kernels import ops
from jitllmd.engine.kv import RowSpan
from jitllmd.engine.layers import formats
from jitllmd.engine.layers import quant as q
from jitllmd.engine.loader import load_model
from jitllmd.engine.models import llama

from .conftest import write_tiny_gguf, write_tiny_llama
from .test_models import _run  # logits of every token, fed chunk by chunk through one session

T = gguf.GGMLQuantizationType
GGUF_WRITES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")  # gguf-py quantizes these; the K-quants it only reads


def _blocks(name: str, rows: int, k: int, seed: int = 0) -> np.ndarray:
    """rows x k weights in format `name` as bytes [rows, row bytes]: gguf's quantizer where it has one, else random
    blocks with sane f16 scales (every bit pattern of the rest is a valid block)."""
    rng = np.random.default_rng(seed)
    if name in GGUF_WRITES:
        return gguf.quants.quantize(rng.standard_normal((rows, k)).astype(np.float32), T[name])
    fmt = formats.FORMATS[name]
    b = rng.integers(0, 256, (rows * k // fmt.block, fmt.nbytes), dtype=np.uint8)
    for at in ([208] if name == "Q6_K" else [0, 2]):
        b[:, at : at + 2] = rng.uniform(0.01, 0.1, (b.shape[0], 1)).astype(np.float16).view(np.uint8)
    return b.reshape(rows, -1)


@pytest.mark.parametrize("name", list(formats.FORMATS))
def test_reference_dequantize_matches_gguf(name: str) -> None:
    b = _blocks(name, 6, 512)
    want = gguf.quants.dequantize(b, T[name]).reshape(6, 512)
    fmt = formats.FORMATS[name]
    held = formats.to_lanes(torch.from_numpy(b).reshape(-1, fmt.nbytes), fmt)  # the engine's order (K-formats' codes in lanes)
    got = formats.dequantize(held, fmt, 6, 512)
    assert torch.equal(got, torch.from_numpy(want))


@pytest.mark.parametrize("name", ["Q8_0", "Q4_0", "Q5_0"])
def test_quantizers_write_what_llama_cpp_writes(name: str) -> None:
    w = np.random.default_rng(1).standard_normal((40, 256)).astype(np.float32)
    w[3] = 0  # an all-zero row: scale 0
    assert np.array_equal(formats.quantize(torch.from_numpy(w), name).numpy(), gguf.quants.quantize(w, T[name]))


def test_q4_k_quantizer_writes_blocks_gguf_reads() -> None:
    w = torch.randn(64, 512, generator=torch.Generator().manual_seed(2))
    w[5] = 0
    b = formats.quantize(w, "Q4_K")
    assert b.shape == (64, 2 * 144)
    back = torch.from_numpy(gguf.quants.dequantize(b.numpy(), T.Q4_K)).reshape(64, 512)
    q4_k = formats.FORMATS["Q4_K"]
    assert torch.equal(back, formats.dequantize(formats.to_lanes(b.reshape(-1, q4_k.nbytes), q4_k), q4_k, 64, 512))
    assert torch.equal(back[5], torch.zeros(512))
    err = ((back - w).pow(2).mean() / w.pow(2).mean()).sqrt()
    q4_0 = formats.dequantize(formats.quantize(w, "Q4_0"), formats.FORMATS["Q4_0"], 64, 512)
    assert err < ((q4_0 - w).pow(2).mean() / w.pow(2).mean()).sqrt() < 0.1  # a fitted scale and min beat Q4_0's


def test_quantize_needs_rows_its_block_divides() -> None:
    with pytest.raises(ValueError, match="not a multiple of its 256-weight block"):
        formats.quantize(torch.zeros(4, 96), "Q4_K")


# what a quantizer's round trip may lose, as a fraction of its block's largest |x|: half a step of Q8_0's grid, a whole
# step of Q4_0's and Q5_0's (the end opposite the largest clamps), a 4-bit step of a Q4_K sub-block's range (at most
# twice that); and on the first three the f16 rounding of the scale (2^-11 of it) times the quants' largest magnitude
ROUND_TRIP = {"Q8_0": (0.5 + 127 * 2**-11) / 127, "Q4_0": (1 + 7 * 2**-11) / 8, "Q5_0": (1 + 15 * 2**-11) / 16, "Q4_K": 2 / 15}


def test_every_record_round_trips_and_both_tables_hold_the_same_records() -> None:
    """FORMATS (by name) and BY_GGML (by ggml id) hold the very same records; every record with a quantizer gives
    back, through its own reference, each weight within its bound, and a zero block as zeros."""
    by_name, by_ggml = list(formats.FORMATS.values()), list(formats.BY_GGML.values())
    assert len(by_name) == len(by_ggml) and all(a is b for a, b in zip(by_name, by_ggml))
    assert all(formats.FORMATS[f.name] is f and formats.BY_GGML[f.ggml] is f for f in by_name)
    assert {f.name for f in by_name if f.quant is not None} == set(ROUND_TRIP)
    assert all(formats.quantizable(f.name, 2 * f.block) == (f.quant is not None) for f in by_name)
    g = torch.Generator().manual_seed(4)
    for fmt in by_name:
        if fmt.quant is None:
            continue
        x = torch.randn(600, fmt.block, generator=g) * torch.logspace(-1, 2, 600).unsqueeze(1)  # scales f16 holds exactly enough
        x[::5] = torch.rand(x[::5].shape, generator=g)  # blocks of one sign
        x[3] = 0
        blocks = fmt.quant(x)
        assert blocks.dtype == torch.uint8 and blocks.shape == (600, fmt.nbytes)
        back = fmt.dequant(blocks)
        assert back.shape == x.shape and not back[3].any()
        assert ((back - x).abs() <= ROUND_TRIP[fmt.name] * x.abs().amax(1, keepdim=True)).all(), fmt.name


# -- tiny models kept quantized ----------------------------------------------------------------------------------------

# a llama.cpp-style mix over one model: q, k and v of three types stack into one projection, as Q4_K_M files do
MIX = {"attn_q": "Q4_0", "attn_k": "Q4_1", "attn_v": "Q8_0", "attn_output": "Q5_0", "ffn_gate": "Q5_1", "ffn_up": "Q5_0",
       "ffn_down": "Q4_0", "token_embd": "Q8_0", "output": "Q4_1"}
WIDE = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2}  # K-quant rows


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("quant")
    narrow_dir, narrow = write_tiny_llama(d / "narrow")
    wide_dir, wide = write_tiny_llama(d / "wide", tie_word_embeddings=True, **WIDE)
    return {"narrow": (narrow_dir, narrow), "wide": (wide_dir, wide), "wide_dir": wide_dir, "d": d}


CASES = ["gguf-mix", "q8_0", "q4_0", "q4_k"]


def _dequantized(path, out):
    """The same .jlm with every quantized tensor dequantized to f32: the reference a quantized model is held to."""
    jlm = JLMFile(path)
    quant = jlm.meta["quantization"]
    specs = []
    for name in jlm.names:
        t = jlm.tensor(name)
        if name in quant:
            fmt, (n, k) = formats.FORMATS[quant[name]["type"]], quant[name]["shape"]
            specs.append(TensorSpec(name, torch.float32, (n, k), lambda t=t, fmt=fmt, n=n, k=k: formats.dequantize(t, fmt, n, k)))
        else:
            specs.append(TensorSpec(name, t.dtype, tuple(t.shape), lambda t=t: t.clone()))
    meta = {k: v for k, v in jlm.meta.items() if k != "format_version"} | {"quantization": {}}
    write_jlm(out, specs, meta)
    return out


@pytest.fixture(scope="module", params=CASES)
def case(request, tiny):
    d = tiny["d"]
    if request.param == "gguf-mix":
        hf_dir, model = tiny["narrow"]
        src = write_tiny_gguf(d / "mix.gguf", hf_dir, model, quant=MIX)
        result = convert(src, d / "mix.jlm")  # auto: a quantized GGUF keeps its blocks
    else:
        result = convert(tiny["wide_dir"], d / f"{request.param}.jlm", request.param)
    ref = _dequantized(result.path, d / f"{request.param}-f32.jlm")
    return request.param, result, ref


@pytest.fixture(params=kernels.variants() + ["reference"] if kernels.rows_kernel() is not None else ["reference"])
def path(request, monkeypatch):
    """Each compiled variant this CPU runs, and the torch reference (dequantize, then multiply)."""
    if request.param == "reference":
        monkeypatch.setattr(q, "rows_kernel", lambda: None)
    else:
        kernels.use_variant(request.param)
    yield request.param
    kernels.use_variant(None)


PROMPT = [5, 17, 33, 2, 64, 80, 11, 11, 42, 9, 90, 3, 27, 14, 15, 60, 61, 62, 8, 19, 21, 70, 71, 4]


def test_kept_blocks_are_the_gguf_s_own_bytes(tiny) -> None:
    hf_dir, model = tiny["narrow"]
    src = write_tiny_gguf(tiny["d"] / "mix-bytes.gguf", hf_dir, model, quant=MIX)
    result = convert(src, tiny["d"] / "mix-bytes.jlm")
    jlm, reader = JLMFile(result.path), gguf.GGUFReader(src)
    quant = jlm.meta["quantization"]
    assert quant["blocks.0.self_attn.v_proj.weight"] == {"type": "Q8_0", "shape": [32, 64]}
    assert {e["type"] for e in quant.values()} == set(MIX.values())
    assert result.types == {"F32": 5, "Q8_0": 3, "Q4_0": 4, "Q5_0": 4, "Q4_1": 3, "Q5_1": 2}
    for t in reader.tensors:
        if t.name in ("blk.1.attn_v.weight", "blk.1.ffn_down.weight", "token_embd.weight", "output.weight"):
            name = {"blk.1.attn_v.weight": "blocks.1.self_attn.v_proj.weight", "blk.1.ffn_down.weight": "blocks.1.mlp.down_proj.weight",
                    "token_embd.weight": "embed.weight", "output.weight": "head.lm_head.weight"}[t.name]
            assert np.array_equal(jlm.tensor(name).numpy().reshape(-1), np.asarray(t.data).reshape(-1))
    weights = sum(int(t.n_bytes) for t in reader.tensors)
    assert sum(jlm.locate(n)[3] for n in jlm.names) == weights  # not a byte more than the GGUF's tensors


def test_k_format_blocks_are_held_in_lane_order(tiny) -> None:
    """A GGUF's Q4_K rows are a .jlm's (format version 2) with each superblock's 128 code bytes in lane order (the
    kernels' order, formats.lanes_: its own inverse), the rest of the block as it was; the model runs on them as on the
    GGUF's weights dequantized. A version 1 file (ggml's order) of K-format blocks is refused with what to do; one of
    none opens, its bytes being the same."""
    wide_dir, wide = tiny["wide"]
    src = write_tiny_gguf(tiny["d"] / "k.gguf", wide_dir, wide, quant={"ffn_down": "Q4_K", "attn_q": "Q8_0"})
    result = convert(src, tiny["d"] / "k.jlm")
    jlm, reader, fmt = JLMFile(result.path), gguf.GGUFReader(src), formats.FORMATS["Q4_K"]
    assert jlm.meta["format_version"] == 2 and result.types["Q4_K"] == 2
    theirs = torch.from_numpy(np.asarray(next(t for t in reader.tensors if t.name == "blk.1.ffn_down.weight").data).reshape(-1, fmt.nbytes).copy())
    ours = jlm.tensor("blocks.1.mlp.down_proj.weight").reshape(-1, fmt.nbytes)
    assert torch.equal(ours, formats.to_lanes(theirs, fmt)) and not torch.equal(ours, theirs)
    assert torch.equal(ours[:, :16], theirs[:, :16]) and torch.equal(formats.to_lanes(ours, fmt), theirs)
    want = torch.from_numpy(gguf.quants.dequantize(theirs.numpy(), T.Q4_K)).reshape(256, 512)
    assert torch.equal(formats.dequantize(ours, fmt, 256, 512), want)
    if kernels.rows_kernel() is not None:
        assert torch.equal(ops.dequant_rows(ours.reshape(256, -1).contiguous(), fmt.ggml, 256, 512), want)
    for kind, ok in (("Q4_K", False), ("Q8_0", True)):
        k_fmt = formats.FORMATS[kind]
        old = tiny["d"] / f"v1-{kind}.jlm"
        spec = TensorSpec("head.lm_head.weight", torch.uint8, (2, k_fmt.row_bytes(256)), lambda k_fmt=k_fmt: torch.zeros(2, k_fmt.row_bytes(256), dtype=torch.uint8))
        write_jlm(old, [spec], {"format_version": 1, "source": {"kind": "gguf", "file": "tiny.gguf"}, "quantization": {spec.name: {"type": kind, "shape": [2, 256]}}})
        if ok:
            assert JLMFile(old).meta["format_version"] == 1
        else:
            with pytest.raises(JLMError, match=r"older jitllmd \(.jlm format version 1\), whose Q4_K blocks .* again \(jitllmd convert tiny.gguf -o v1-Q4_K.jlm\)"):
                JLMFile(old)


def _int8_rows(x: torch.Tensor) -> torch.Tensor:
    """x as the kernels see it: each 32 inputs rounded (to nearest even) to an int8 grid of step d = amax / 127,
    computed as the kernels compute it (x * (1 / d) in f32)."""
    b = x.float().reshape(x.shape[0], -1, 32)
    d = b.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / torch.where(d == 0, torch.ones_like(d), d))
    return (torch.round(b * inv) * d).reshape(x.shape)


FEEDS = {"at once": [PROMPT], "in chunks": [PROMPT[:10], PROMPT[10:17], PROMPT[17:]], "token by token": [[t] for t in PROMPT]}


@pytest.mark.parametrize("feed", FEEDS)
def test_rounds_only_where_documented(case, path, feed, monkeypatch) -> None:
    """Decode rows (short rows): the kernels quantize x to int8 per 32 inputs, and that is their only rounding beside
    f32 sums: every such product equals the reference's on the same input so rounded (checked call by call: a 1-ulp
    difference upstream may move a later rounding by one step, and a model amplifies it), and the logits stay near
    the f32 model's, greedy mostly the same. A prompt chunk is multiplied on variants with bf16 units with x and W
    rounded to bf16 and nothing else, elsewhere as an int8 GEMM with the decode rows' rounding (each product the
    reference's on x so rounded), fed whole or after earlier chunks. The reference path is the f32 model's sums throughout. K/V stay f32 here, as the f32 model's
    (test_an_f16_cache_rounds_kv_only: the one rounding more that a quantized model's own f16 cache makes)."""
    name, result, ref = case
    monkeypatch.setattr(llama, "QuantLayer", lambda *args, **kwargs: None)  # each projection a call of its own, to check (layer.c's: the same bits)
    monkeypatch.setattr(llama, "MLP_COLUMNS", 64 if name == "gguf-mix" else 256)  # a bf16 chunk's MLP in 2 slices (96: 64 + 32; 512)
    want = _run(load_model(ref, max_seq=64), [PROMPT])
    scale = want.abs().max()
    run, calls = q.QuantLinear._run, {True: [], False: []}
    bf16 = path != "reference" and ops.bf16_units() is not None  # prompt chunks in bf16
    bf = lambda t: t.bfloat16().float() if bf16 else t

    def checked(self, x, exact, norm=None, gated=False, add=None, out=None):
        y = run(self, x, exact, norm, gated, add, out)
        if path != "reference" and not (exact and bf16):  # bf16 products: checked in bf16_runs, below
            if norm is not None or gated:  # folded into the kernel's quantizing: the same f32 rows the kernels make
                x = ops.rms_norm_rows(x, *norm) if norm is not None else ops.gated_rows(x, gated)
            xs = _int8_rows(x)  # decode rows, and prompt chunks without bf16 units (the int8 GEMM): x on its int8 grid
            rounded = torch.cat([xs @ formats.dequantize(w, s.fmt, s.rows, s.k).t() for s, w in zip(self.segments, self.views)], 1)
            if add is not None:  # the residual (or bias) the kernel adds in its sums
                rounded = add + rounded
            calls[exact].append(((y - rounded).abs().max() / rounded.abs().max()).item())
        return y

    monkeypatch.setattr(q.QuantLinear, "_run", checked)
    bf16_runs, bf16_calls = q.bf16_runs, []

    def checked_bf16(x, runs, n, *, norm=None, gated=False, add=None, out=None):
        """Every bf16 product (whole projections, and the MLP's column slices) against its bf16-rounded inputs."""
        y = bf16_runs(x, runs, n, norm=norm, gated=gated, add=add, out=out)
        if isinstance(x, ops.BF16Rows):  # rows rounded once for several products (checked in bf16_round, below)
            a = x.data[: x.rows].float()
        else:
            a = ops.rms_norm_rows(x, *norm) if norm is not None else ops.gated_rows(x, gated) if gated else x
        fmts = {f.ggml: f for f in formats.FORMATS.values()}
        rounded = torch.cat([bf(a) @ bf(formats.dequantize(w, fmts[t], rows, a.shape[1])).t() for w, t, rows in runs], 1)
        if add is not None:
            rounded = add + rounded
        bf16_calls.append(((y - rounded).abs().max() / rounded.abs().max()).item())
        return y

    monkeypatch.setattr(q, "bf16_runs", checked_bf16)
    bf16_round, rounds = llama.bf16_round, []

    def checked_round(x, *, norm=None, gated=False):
        """Rows made and rounded once for the MLP's slices: the bits of bf16(the f32 rows made first), zero past them."""
        xb = bf16_round(x, norm=norm, gated=gated)
        made = ops.rms_norm_rows(x, *norm) if norm is not None else ops.gated_rows(x, gated) if gated else x
        rounds.append(torch.equal(xb.data[: xb.rows], made.bfloat16()) and not xb.data[xb.rows :].any())
        return xb

    monkeypatch.setattr(llama, "bf16_round", checked_round)
    got = _run(load_model(result.path, max_seq=64, kv_dtype=torch.float32), FEEDS[feed])
    if path == "reference":
        assert (got - want).abs().max() / scale < 1e-5
        return
    if feed != "token by token" and bf16:  # prompt chunks in bf16: qkv, o and the head whole, the MLP by column slices
        assert len(bf16_calls) >= len(FEEDS[feed]) * (4 * 2 + 1) and max(bf16_calls) < 1e-5 and not calls[True] and not calls[False]
        assert len(rounds) == len(FEEDS[feed]) * 2 and all(rounds)  # once per layer's MLP
    elif feed != "token by token":  # prompt chunks in the int8 GEMM: each product the reference's on int8-rounded x
        assert len(calls[True]) == len(FEEDS[feed]) * (4 * 2 + 1) and max(calls[True]) < 1e-5 and not calls[False]
    else:
        assert not calls[True] and len(calls[False]) == len(PROMPT) * (4 * 2 + 1) and max(calls[False]) < 1e-5
    assert (got - want).abs().max() / scale < 0.1
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.75  # near-flat logits of a random model: the real ones agree at >= 97%


def test_an_f16_cache_rounds_kv_only(case, path) -> None:
    """A kept-quantized model keeps its sessions' K/V in f16 (half the bytes, as llama.cpp): every value rounds once
    to f16's 11 significant bits, which moves the logits a little."""
    name, result, _ = case
    f16 = load_model(result.path, max_seq=64)
    assert f16.new_kv().dtype == torch.float16 and f16.new_kv(10).bytes_per_position() * 2 == load_model(
        result.path, max_seq=64, kv_dtype=torch.float32).new_kv(10).bytes_per_position()
    for feed in ([PROMPT], [[t] for t in PROMPT]):
        got, want = _run(f16, feed), _run(load_model(result.path, max_seq=64, kv_dtype=torch.float32), feed)
        change, same = ((got - want).abs().max() / want.abs().max()).item(), (got.argmax(-1) == want.argmax(-1)).float().mean().item()
        if path == "reference":  # exact: the f16 rounding alone (0.06-0.23% here)
            assert 0 < change < 5e-3 and same == 1.0
        else:  # int8 (decode rows, prompt chunks without bf16 units) or bf16 inputs: a value moved by f16 may round to the next int8 or
            # bf16 step, as any 1-ulp change may
            assert 0 < change < 0.1 and same >= 0.75  # those paths' own bounds against f32 (above)


def test_packed_rows_equal_rows_alone(case, path) -> None:
    """Two sessions' decode rows in one step against each alone."""
    name, result, _ = case
    loaded = load_model(result.path, max_seq=64)
    a, b = loaded.new_kv(), loaded.new_kv()
    alone = []
    for kv, ids in ((a, PROMPT[:5]), (b, PROMPT[7:10])):
        loaded.runner.forward(torch.tensor(ids), torch.arange(len(ids)), [RowSpan(0, len(ids), kv)])
    solo_a, solo_b = loaded.new_kv(), loaded.new_kv()
    for kv, ids in ((solo_a, PROMPT[:5]), (solo_b, PROMPT[7:10])):
        loaded.runner.forward(torch.tensor(ids), torch.arange(len(ids)), [RowSpan(0, len(ids), kv)])
    for kv, t in ((solo_a, 50), (solo_b, 51)):
        alone.append(loaded.runner.forward(torch.tensor([t]), torch.tensor([kv.length]), [RowSpan(0, 1, kv)])[-1])
    packed = loaded.runner.forward(torch.tensor([50, 51]), torch.tensor([a.length, b.length]), [RowSpan(0, 1, a), RowSpan(1, 1, b)])
    if path == "reference":  # torch's GEMM may sum two rows in another order than one, and an f32 K/V value 1 ulp
        # apart may round to the next f16 (2^-11 relative) in the cache
        torch.testing.assert_close(packed, torch.stack(alone), rtol=1e-4, atol=1e-4)
    else:  # the kernels sum each (row, output) one way whatever the rows beside it
        assert torch.equal(packed[0], alone[0]) and torch.equal(packed[1], alone[1])


def test_a_prompt_chunk_and_decode_rows_are_the_same_beside_each_other(case, path, monkeypatch) -> None:
    """A step holding a prompt chunk, a decode row and a row with guesses (a short feed: decode's products) gives each
    the bits it has alone: the chunk's (a bf16 chunk's MLP by column slices either way, here two of them; its
    attention in bf16 where AMX runs and the heads are 64 wide), and the decode rows' (their attention the decode
    kernel's token by token, as layer.c's one call attends them alone, not the chunk kernel's)."""
    name, result, _ = case
    if path == "reference":
        pytest.skip("torch's GEMM may sum rows in another order beside others")
    monkeypatch.setattr(llama, "MLP_COLUMNS", 64 if name == "gguf-mix" else 256)
    loaded = load_model(result.path, max_seq=64)
    blocks = [loaded.runner.placement.pager.resident[f"blocks.{i}"] for i in range(loaded.runner.model.cfg.num_layers)]
    assert all(b.attn.bf16 == (ops.bf16_units() == "amx" and name != "gguf-mix") for b in blocks)  # gguf-mix: heads of 16
    forward = loaded.runner.forward
    alone = forward(torch.tensor(PROMPT[:9]), torch.arange(9), [RowSpan(0, 9, loaded.new_kv())])
    kvs = [loaded.new_kv() for _ in range(6)]  # a decode row's and a guessing row's sessions, three times
    for kv in kvs:
        forward(torch.tensor(PROMPT[10:14]), torch.arange(4), [RowSpan(0, 4, kv)])
    decode = forward(torch.tensor([PROMPT[20]]), torch.tensor([4]), [RowSpan(0, 1, kvs[0])])
    guesses = forward(torch.tensor(PROMPT[21:24]), torch.arange(4, 7), [RowSpan(0, 3, kvs[1], short=True)])
    bits = lambda t: t.view(torch.int32)
    for a, b, at in ((2, 3, None), (4, 5, torch.tensor([0, 1, 2, 3, 12]))):  # every token's logits; a step's (the last layer's `keep`)
        mixed = forward(torch.tensor([PROMPT[20], *PROMPT[21:24], *PROMPT[:9]]), torch.tensor([4, 4, 5, 6, *range(9)]),
                        [RowSpan(0, 1, kvs[a]), RowSpan(1, 3, kvs[b], short=True), RowSpan(4, 9, loaded.new_kv())], at)
        chunk = alone if at is None else alone[-1:]
        assert torch.equal(bits(mixed[4:]), bits(chunk)) and torch.equal(bits(mixed[:1]), bits(decode)) and torch.equal(bits(mixed[1:4]), bits(guesses))


class _Indexes(torch.overrides.TorchFunctionMode):
    """Records the torch ops that index a tensor by a tensor or a list (getitem, setitem): on the CPU their kernel starts
    torch's own threads whatever their size, which then spin beside the kernels' pool on the same cores."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        if name in ("__getitem__", "__setitem__") and any(isinstance(i, (torch.Tensor, list)) for i in _flat(args[1:2], lists=False)):
            self.seen.append(name)
        return func(*args, **(kwargs or {}))


def _flat(items, lists: bool = True) -> list:
    """An index's parts: a tuple's items (and a list's where `lists`)."""
    return [j for i in items for j in (i if isinstance(i, (tuple, list) if lists else tuple) else (i,))]


def test_a_step_of_decode_rows_and_a_prompt_indexes_no_tensor_by_a_tensor(case, path) -> None:
    """A decode step and a step mixing a prompt chunk with decode rows, as the engine runs them (logits of the rows'
    last tokens): the embedding's rows gathered by the dequant kernel, the head's and attention's rows by slices."""
    name, result, _ = case
    if path == "reference":
        pytest.skip("torch's own ops throughout")
    loaded = load_model(result.path, max_seq=64)
    forward = loaded.runner._forward
    kvs = [loaded.new_kv() for _ in range(3)]
    for kv in kvs:
        forward(PROMPT[10:14], list(range(4)), [RowSpan(0, 4, kv)], [3])
    with _Indexes() as seen:
        forward(PROMPT[20:23], [4, 4, 4], [RowSpan(i, 1, kv) for i, kv in enumerate(kvs)], [0, 1, 2])
        forward([PROMPT[23], *PROMPT[:9], PROMPT[22]], [5, *range(9), 5], [RowSpan(0, 1, kvs[0]), RowSpan(1, 9, loaded.new_kv(), prompt=True),
                RowSpan(10, 1, kvs[1])], [0, 9, 10])
    assert seen.seen == []


def decode_both_ways(loaded, ids: list[int], steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits of decode rows through every layer in one kernel call (layer.c) and through the same layers call by
    call from Python, as (fused, call by call): three sessions prefilled from `ids`, one row alone, then `steps` steps
    of the three sessions' rows packed."""
    blocks = [loaded.runner.placement.pager.resident[f"blocks.{i}"] for i in range(loaded.runner.model.cfg.num_layers)]  # host blocks, kept
    assert all(b.fused is not None for b in blocks)
    fused = [b.fused for b in blocks]

    def decode() -> torch.Tensor:
        kvs = [loaded.new_kv() for _ in range(3)]
        for kv, prompt in zip(kvs, (ids[:5], ids[5:7], ids[9:20])):
            loaded.runner.forward(torch.tensor(prompt), torch.arange(len(prompt)), [RowSpan(0, len(prompt), kv)])
        out = [loaded.runner.forward(torch.tensor([ids[1]]), torch.tensor([kvs[0].length]), [RowSpan(0, 1, kvs[0])])]
        for step in range(steps):
            out.append(loaded.runner.forward(torch.tensor(ids[step : step + 3]), torch.tensor([kv.length for kv in kvs]),
                                             [RowSpan(i, 1, kv) for i, kv in enumerate(kvs)]))
        return torch.cat(out)

    together = decode()
    try:
        for b in blocks:
            b.fused = None
        apart = decode()
    finally:
        for b, f in zip(blocks, fused):
            b.fused = f
    return together, apart


def test_a_layer_in_one_call_is_the_layer_call_by_call(case, path) -> None:
    """Decode rows of a quantized model run each layer in one kernel call (layer.c): the same bits as the layer's
    kernel calls from Python, for one row and for rows of several sessions packed."""
    name, result, _ = case
    if path == "reference":
        pytest.skip("the reference path has no kernels to fuse")
    together, apart = decode_both_ways(load_model(result.path, max_seq=64), PROMPT, 3)
    assert torch.equal(together.view(torch.int32), apart.view(torch.int32))


def test_convert_quantizes_with_fallbacks(tiny) -> None:
    """Rows of 64 inputs take no 256-weight block: -dtype q4_k falls back to Q5_0 there, and says so."""
    hf_dir, _ = tiny["narrow"]
    result = convert(hf_dir, tiny["d"] / "narrow-q4k.jlm", "q4_k")
    quant = JLMFile(result.path).meta["quantization"]
    assert quant["head.lm_head.weight"]["type"] == "Q8_0"
    assert quant["blocks.0.mlp.down_proj.weight"]["type"] == "Q5_0"  # 96 inputs: three 32-weight blocks
    assert any("not Q4_K" in note for note in result.notes)


def test_an_encoder_is_not_quantized(minilm_dir, tmp_path) -> None:
    with pytest.raises(ConvertError, match="embedding model is stored as floats"):
        convert(minilm_dir, tmp_path / "e.jlm", "q8_0")
