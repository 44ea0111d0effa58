"""Short prompt feeds (a follow-up turn's few new tokens) run as decode rows do, each layer in one fused call: through
the decode rows' integer kernel the same bits as feeding those tokens one decode step at a time, under every kernel
variant this CPU runs; a feed past the formats' figure (`many`) takes a prompt chunk's products there (bf16 or the
int8 GEMM), each token's result still its own whatever rows share its step. The engine marks a feed short (and
many) from its own count of new tokens, never from its neighbours."""

from __future__ import annotations

import pytest
import torch

from jitllmd.engine import kernels
from jitllmd.engine.engine import Engine
from jitllmd.engine.kernels import build as kernel_build
from jitllmd.engine.kernels import ops
from jitllmd.engine.kv import RowSpan
from jitllmd.engine.layers.formats import FORMATS
from jitllmd.engine.layers.quant import FUSED_FEED, short_feed
from jitllmd.engine.request import Generation
from jitllmd.engine.sampler import SamplingParams
from tests.test_engine import collect

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(params=kernels.variants() or [None])
def variant(request):
    kernels.use_variant(request.param)
    yield request.param
    kernels.use_variant(None)


def _spy_layers(monkeypatch, seen) -> None:
    """seen(rows, many) for each layer a fused call runs, whether a step calls its layers one by one or all in one call
    (both are layers/fused.py's decode_stack calls)."""
    from jitllmd.engine.layers import fused

    stack = fused.decode_stack

    def spy(layers, x, *a):
        for _ in layers:
            seen(x.shape[0], a[-1])
        return stack(layers, x, *a)

    monkeypatch.setattr(fused, "decode_stack", spy)


def _history(loaded, n: int):
    kv = loaded.new_kv(256)
    ids = torch.arange(3, 3 + n) % loaded.model.cfg.vocab_size
    loaded.runner.forward(ids, torch.arange(n), [RowSpan(0, n, kv)], torch.tensor([n - 1]))
    return kv


@pytest.mark.parametrize("model", ["tiny_serve_q8_jlm", "tiny_gemma_q8_jlm"])
def test_a_short_feed_gives_the_bits_of_one_token_a_step(request, monkeypatch, variant, model: str) -> None:
    """llama's layers take it in one fused call per layer, each token a row attending up to its own position: the
    logits and K/V of feeding the tokens one at a time, exactly. Gemma's (a window of 8, crossed here) go through the
    Python path, whose chunk attention sums in its own order: the same up to f32 rounding (where AMX runs, a prompt
    row's attention is bf16 for both families: the same up to bf16's)."""
    from jitllmd.engine.loader import load_model

    fused_rows: list[int] = []
    _spy_layers(monkeypatch, lambda rows, many: fused_rows.append(rows))
    loaded = load_model(request.getfixturevalue(model), max_seq=256)
    new = [17, 5, 30, 9, 2, 41]
    a, b = _history(loaded, 12), _history(loaded, 12)
    n = len(new)
    fed = loaded.runner.forward(torch.tensor(new), torch.arange(12, 12 + n), [RowSpan(0, n, a, prompt=True, short=True)], torch.arange(n))
    one_by_one = torch.cat([loaded.runner.forward(torch.tensor([t]), torch.tensor([12 + j]), [RowSpan(0, 1, b)]) for j, t in enumerate(new)])
    amx = ops.bf16_units() == "amx"  # a prompt row attends in bf16 on AMX tiles: the Python path, its own rounding
    fused = model == "tiny_serve_q8_jlm" and variant is not None and not amx
    if fused:  # the path under test: one call of six rows per layer
        assert fused_rows.count(len(new)) == loaded.model.cfg.num_layers, fused_rows

    def same(x: torch.Tensor, y: torch.Tensor) -> bool:
        if fused:
            return torch.equal(x, y)
        tol = 0.05 * y.float().abs().max().item() if amx else 1e-5
        return torch.allclose(x.float(), y.float(), rtol=0 if amx else 1e-4, atol=tol)

    assert same(fed, one_by_one), (variant, (fed - one_by_one).abs().max())
    for layer in range(loaded.model.cfg.num_layers):
        (ka, va), (kb, vb) = a.read(layer, 0, 12 + n), b.read(layer, 0, 12 + n)
        assert same(ka, kb) and same(va, vb), layer
    exact = _history(loaded, 12)  # the same feed as a prompt chunk: the exact path, close but its own bits
    chunked = loaded.runner.forward(torch.tensor(new), torch.arange(12, 12 + n), [RowSpan(0, n, exact, prompt=True)], torch.arange(n))
    assert torch.allclose(chunked, fed, atol=0.05 * fed.abs().max().item())


def test_the_table_takes_the_least_of_a_models_formats() -> None:
    rows = min(FORMATS["Q4_K"].short["avx2+fma"], FORMATS["Q6_K"].short["avx2+fma"])
    assert short_feed({"Q4_K", "Q6_K"}, "avx2+fma") == (max(rows, FUSED_FEED["avx2+fma"]), rows)
    assert short_feed({"Q8_0"}, "avx512+amx") == (FORMATS["Q8_0"].short["avx512+amx"],) * 2  # no fused prompt rows there: the few-row kernel's alone
    assert short_feed({"Q8_0"}, None) == (0, 0)  # no kernels: nothing to mark
    assert short_feed(set(), "avx2+fma") == (0, 0)  # a float model's few-row kernels need no marking
    variants = set(kernel_build._VARIANTS)  # every variant built, whatever this CPU runs
    assert set(FUSED_FEED) == variants
    for f in FORMATS.values():  # every format has a figure for every variant
        assert set(f.short) == variants and all(v >= 0 for v in f.short.values())


def test_a_long_short_feed_takes_a_chunks_products_and_keeps_to_its_own_row(monkeypatch, variant, tiny_serve_q8_jlm) -> None:
    """A short feed marked `many` goes through each layer's fused call with a prompt chunk's products (bf16 where the
    CPU has the units, else the int8 GEMM; the call told so, token by token): its logits and K/V are the same bits
    alone and in a step between two decode rows of other sessions (whose own logits are theirs alone too: one fused
    call, three runs of tokens of two kinds), and within the rounding of feeding its tokens one at a time."""
    from jitllmd.engine.loader import load_model

    flags: list[list[bool] | None] = []
    _spy_layers(monkeypatch, lambda rows, many: flags.append(many))
    loaded = load_model(tiny_serve_q8_jlm, max_seq=256)
    new = [17, 5, 30, 9, 2, 41]
    n = len(new)
    a, b, solo = _history(loaded, 12), _history(loaded, 12), _history(loaded, 12)
    c, d = _history(loaded, 7), _history(loaded, 9)
    alone = loaded.runner.forward(torch.tensor(new), torch.arange(12, 12 + n), [RowSpan(0, n, a, prompt=True, short=True, many=True)], torch.arange(n))
    c_alone = loaded.runner.forward(torch.tensor([3]), torch.tensor([7]), [RowSpan(0, 1, c)])
    d_alone = loaded.runner.forward(torch.tensor([4]), torch.tensor([9]), [RowSpan(0, 1, d)])
    for kv, length in ((c, 7), (d, 9)):
        kv.truncate(length)
    flags.clear()
    rows = [RowSpan(0, 1, c), RowSpan(1, n, b, prompt=True, short=True, many=True), RowSpan(1 + n, 1, d)]
    mixed = loaded.runner.forward(torch.tensor([3, *new, 4]), torch.tensor([7, *range(12, 12 + n), 9]), rows, torch.arange(n + 2))
    kernel = variant is not None and ops.bf16_units() != "amx"  # AMX: a prompt row's attention is the Python path's (its bf16 chunk)
    if kernel:
        assert flags == [[False] + [True] * n + [False]] * loaded.model.cfg.num_layers, flags[:2]
        assert torch.equal(mixed[1 : 1 + n], alone) and torch.equal(mixed[0], c_alone[0]) and torch.equal(mixed[-1], d_alone[0])
        for layer_i in range(loaded.model.cfg.num_layers):
            (ka, va), (kb, vb) = a.read(layer_i, 0, 12 + n), b.read(layer_i, 0, 12 + n)
            assert torch.equal(ka, kb) and torch.equal(va, vb)
    one_by_one = torch.cat([loaded.runner.forward(torch.tensor([t]), torch.tensor([12 + j]), [RowSpan(0, 1, solo)]) for j, t in enumerate(new)])
    assert torch.allclose(alone, one_by_one, atol=0.05 * one_by_one.abs().max().item())


def test_the_engine_marks_a_feed_short_from_its_own_new_tokens(tiny_serve_q8_jlm, monkeypatch) -> None:
    """A session's first turn (a long prompt) runs exactly, its follow-up of a few new tokens runs short; decode rows
    are no prompt rows; a scored prompt follows the same rule. A repeated request, which feeds only its prompt's last
    token, makes it as the first run did (exactly after a long prompt, short after a short one), and gives the tokens
    the first gave."""
    engine = Engine.load(tiny_serve_q8_jlm, max_batch=2, max_seq=256)
    engine.loaded.runner.short_feed, engine.loaded.runner.rows_feed = 8, 5
    seen: list[tuple[int, bool, bool]] = []
    many: list[bool] = []
    forward = engine.loaded.runner.forward

    def spy(token_ids, positions, rows, logits_at=None):
        seen.extend((r.num_tokens, r.prompt, r.short) for r in rows)
        many.extend(r.many for r in rows)
        return forward(token_ids, positions, rows, logits_at)

    monkeypatch.setattr(engine.loaded.runner, "forward", spy)
    try:
        s = engine.new_session()
        collect(engine.generate(Generation(list(range(3, 23)), GREEDY, max_tokens=3, ignore_eos=True, session=s)))
        assert seen[0] == (20, True, 0) and all(not p for _, p, _ in seen[1:]), seen
        seen.clear()
        collect(engine.generate(Generation(s.token_ids + [7, 8, 9, 10], GREEDY, max_tokens=3, ignore_eos=True, session=s)))
        assert seen[0] == (4, True, True) and not any(many) and all(not p for _, p, _ in seen[1:]), seen
        seen.clear()
        many.clear()
        collect(engine.generate(Generation(s.token_ids + [11, 12, 13, 14, 15, 16], GREEDY, max_tokens=3, ignore_eos=True, session=s)))
        assert seen[0] == (6, True, True) and many == [True, False, False], (seen, many)  # past rows_feed: a chunk's products, its decode rows not
        seen.clear()
        collect(engine.generate(Generation([7, 8, 9], GREEDY, max_tokens=1, ignore_eos=True, prompt_logprobs=1)))
        assert seen[0][1:] == (True, True), seen
        for prompt, short, gemm in ((list(range(40, 70)), False, False), (list(range(80, 86)), True, True), (list(range(90, 93)), True, False)):
            first, again = (collect(engine.generate(Generation(prompt, GREEDY, max_tokens=8, ignore_eos=True))) for _ in range(2))
            assert again.done.fed_tokens == 1 and seen[-8] == (1, True, short) and again.ids == first.ids, (prompt, seen[-16:])
            assert many[-8] == many[-16] == gemm, (prompt, many[-16:])  # made again the way the first run made it
    finally:
        engine.stop()


@pytest.mark.parametrize("model", ["tiny_serve_q8_jlm", "tiny_gemma_q8_jlm"])
def test_every_layer_in_one_call_gives_the_bits_of_layer_by_layer(request, monkeypatch, variant, model: str) -> None:
    """A step whose every layer is held on the CPU and fuses its rows runs them in one decode_stack call: decode rows of
    two sessions beside a short feed, the logits and each layer's K/V exactly those of the layers called one by one."""
    from jitllmd.engine.layers import fused
    from jitllmd.engine.loader import load_model

    stacked: list[int] = []
    stack = fused.decode_stack
    monkeypatch.setattr(fused, "decode_stack", lambda layers, x, *a: stacked.append(len(layers)) or stack(layers, x, *a))
    loaded = load_model(request.getfixturevalue(model), max_seq=256)
    model_cls = type(loaded.runner.model)

    def step(one_call: bool) -> tuple[torch.Tensor, list]:
        monkeypatch.setattr(model_cls, "stack", staticmethod(fused.stack) if one_call else None)
        kvs = [_history(loaded, 12), _history(loaded, 9), _history(loaded, 12)]
        feed = [17, 5, 30]
        rows = [RowSpan(0, 1, kvs[0]), RowSpan(1, len(feed), kvs[2], prompt=True, short=True), RowSpan(1 + len(feed), 1, kvs[1])]
        ids = torch.tensor([7, *feed, 11])
        positions = torch.tensor([12, 12, 13, 14, 9])
        logits = loaded.runner.forward(ids, positions, rows, torch.arange(len(ids)))
        return logits, [tuple(t.clone() for t in kv.read(i, 0, kv.length)) for kv in kvs for i in range(loaded.model.cfg.num_layers)]

    by_layer, kv_by_layer = step(False)
    kernel = variant is not None and not ops.bf16_attention(loaded.model.cfg.head_dim)  # AMX's prompt rows attend on its tiles: layer by layer
    assert stacked == ([1] * loaded.model.cfg.num_layers if kernel else []), stacked  # a call per layer
    stacked.clear()
    one_call, kv_one_call = step(True)
    assert stacked == ([loaded.model.cfg.num_layers] if kernel else []), stacked  # one call for all
    assert torch.equal(one_call, by_layer)
    assert all(torch.equal(a, b) for (a, _), (b, _) in zip(kv_one_call, kv_by_layer)) and all(torch.equal(a, b) for (_, a), (_, b) in zip(kv_one_call, kv_by_layer))
