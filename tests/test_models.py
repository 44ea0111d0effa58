"""Llama-family parity with transformers on tiny random models: whole prompt, token by token, chunks, packed rows."""

from __future__ import annotations

import pytest
import torch

from jitllmd.engine.convert import convert
from jitllmd.engine.kv import RowSpan
from jitllmd.engine.loader import load_model

from .conftest import write_tiny_hf

TOL = 1e-4
CASES = {
    "llama": ("llama", {}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "llama3-rope": (
        "llama",
        {"rope_parameters": {"rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 32}},
    ),
    "mistral": ("mistral", {"sliding_window": None}),
    "mistral-window": ("mistral", {"sliding_window": 5}),
    "llama-d64": ("llama", {"head_dim": 64}),  # heads of 64: the prompt-chunk attention kernel's case
    "mistral-window-d64": ("mistral", {"sliding_window": 5, "head_dim": 64}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
}


@pytest.fixture(scope="module", params=list(CASES))
def pair(request, tmp_path_factory):
    arch, overrides = CASES[request.param]
    d = tmp_path_factory.mktemp(request.param)
    hf_dir, hf_model = write_tiny_hf(d / "hf", arch, **overrides)
    out = convert(hf_dir, d / "tiny.jlm", "f32")
    return load_model(out.path, max_seq=64), hf_model


def _reference(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0].float()


def _run(loaded, chunks: list[list[int]]) -> torch.Tensor:
    """Feed `chunks` one after another through one session's KV; logits of every token."""
    kv = loaded.new_kv()
    out = []
    for ids in chunks:
        pos = torch.arange(kv.length, kv.length + len(ids))
        out.append(loaded.runner.forward(torch.tensor(ids), pos, [RowSpan(0, len(ids), kv)]))
    return torch.cat(out)


PROMPT = [5, 17, 33, 2, 64, 80, 11, 11, 42, 9, 90, 3, 27]


def test_whole_prompt_matches_transformers(pair):
    loaded, hf = pair
    ours = _run(loaded, [PROMPT])
    assert (ours - _reference(hf, PROMPT)).abs().max().item() <= TOL


def test_a_prompt_longer_than_an_mlp_tile_matches_transformers(pair, monkeypatch):
    """A chunk longer than MLP_ROWS runs its MLP a tile of rows at a time (here 4, 4, 4 and 1 of 13)."""
    from jitllmd.engine.models import llama

    loaded, hf = pair
    monkeypatch.setattr(llama, "MLP_ROWS", 4)
    assert (_run(loaded, [PROMPT]) - _reference(hf, PROMPT)).abs().max().item() <= TOL


def test_token_by_token_through_kv_matches(pair):
    loaded, hf = pair
    ours = _run(loaded, [[t] for t in PROMPT])
    assert (ours - _reference(hf, PROMPT)).abs().max().item() <= TOL


def test_chunks_through_kv_match(pair):
    loaded, hf = pair
    ours = _run(loaded, [PROMPT[:5], PROMPT[5:6], PROMPT[6:]])
    assert (ours - _reference(hf, PROMPT)).abs().max().item() <= TOL


def test_packed_rows_equal_rows_alone(pair):
    """Two sessions in one packed forward: a decode row beside a joining prompt chunk."""
    loaded, hf = pair
    a, b = PROMPT[:7], PROMPT[3:12]
    kv_a, kv_b = loaded.new_kv(), loaded.new_kv()
    m = loaded.runner
    m.forward(torch.tensor(a[:-1]), torch.arange(len(a) - 1), [RowSpan(0, len(a) - 1, kv_a)])
    m.forward(torch.tensor(b[:4]), torch.arange(4), [RowSpan(0, 4, kv_b)])
    tokens = torch.tensor([a[-1]] + b[4:])
    positions = torch.tensor([len(a) - 1] + list(range(4, len(b))))
    rows = [RowSpan(0, 1, kv_a), RowSpan(1, len(b) - 4, kv_b)]
    logits = m.forward(tokens, positions, rows, torch.tensor([0, len(tokens) - 1]))
    assert (logits[0] - _reference(hf, a)[-1]).abs().max().item() <= TOL
    assert (logits[1] - _reference(hf, b)[-1]).abs().max().item() <= TOL
    assert kv_a.length == len(a) and kv_b.length == len(b)


def test_bf16_close_to_f32(pair, tmp_path, bf16_path):
    """bf16 storage stays near the f32 logits on both bf16 paths (upcast, native), whole prompt, token by token and
    a packed decode row, with no dtype warning (warnings are errors): a coarse check that each path is wired right."""
    loaded, hf = pair
    src = loaded.path.parent / "hf"
    bf = load_model(convert(src, tmp_path / "bf16.jlm", "bf16").path, max_seq=64)
    assert bf.model.dtype == torch.bfloat16
    assert bf.model.act == (torch.bfloat16 if bf16_path else torch.float32)
    ref = _reference(hf, PROMPT)
    assert (_run(bf, [PROMPT]) - ref).abs().max().item() < 0.15
    assert (_run(bf, [PROMPT[:6]] + [[t] for t in PROMPT[6:]]) - ref).abs().max().item() < 0.15


@pytest.mark.parametrize("at", [[12], [3, 7, 12], [0], [12, 3]])
def test_logits_of_some_tokens_match(pair, at):
    """Asked for some tokens' logits, the last block runs only those (every token's K/V still kept): the logits
    match, out of order too, and the session goes on from the whole prompt."""
    loaded, hf = pair
    kv = loaded.new_kv()
    m = loaded.runner
    logits = m.forward(torch.tensor(PROMPT), torch.arange(len(PROMPT)), [RowSpan(0, len(PROMPT), kv)], torch.tensor(at))
    ref = _reference(hf, PROMPT)
    assert (logits - ref[at]).abs().max().item() <= TOL
    nxt = m.forward(torch.tensor([7]), torch.tensor([len(PROMPT)]), [RowSpan(0, 1, kv)])
    assert (nxt[0] - _reference(hf, PROMPT + [7])[-1]).abs().max().item() <= TOL


def test_rope_tables_are_rows_of_one_cache() -> None:
    """A forward's RoPE tables are rows of a cache that grows to the furthest position seen: the bits a table made
    afresh for those positions has (any order, repeats, across a growth), and the cache grows only past its end."""
    from jitllmd.engine.layers.rope import RopeCache, rope_inv_freq

    inv = rope_inv_freq(64, 10000.0)
    cache = RopeCache(inv, torch.float32)

    def fresh(positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * inv[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        sin = emb.sin()
        return emb.cos(), torch.cat((-sin[..., :32], sin[..., 32:]), dim=-1)

    for positions in ([5], [0, 1, 2, 3], [900, 7, 7, 1023], [1500, 3], [4097, 4096, 12]):
        p = torch.tensor(positions)
        cos, sin = cache.tables(p).on(torch.device("cpu"))
        want_cos, want_sin = fresh(p)
        assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin), positions
    size = cache._rows[torch.device("cpu")][0].shape[0]
    assert size == 4098  # 1024, doubled to 2048 for 1500, then to the 4098 positions 4097 needs
    cache.tables(torch.tensor([4000, 1]))
    assert cache._rows[torch.device("cpu")][0].shape[0] == size
