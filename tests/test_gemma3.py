"""Gemma 3 against transformers' Gemma3ForCausalLM on tiny random configs whose window is shorter than the prompt:
whole prompt, token by token past the window (local layers' KV dropping what no query sees), chunks, packed rows;
converted from a Hugging Face directory and from a GGUF as llama.cpp writes it."""

from __future__ import annotations

import pytest
import torch

from jitllmd.engine import kernels
from jitllmd.engine import kv as kv_module
from jitllmd.engine.convert import convert
from jitllmd.engine.jlm import JLMFile
from jitllmd.engine.kv import PAGE, RowSpan
from jitllmd.engine.loader import load_model
from jitllmd.engine.request import Generation

from .conftest import write_tiny_gguf, write_tiny_hf

# The Llama family's parity tests, run here against this module's `pair` (a Gemma 3 and transformers' own): whole
# prompt, a prompt longer than an MLP tile, token by token, chunks, packed rows, some tokens' logits, bf16 storage
from .test_models import (  # noqa: F401
    PROMPT,
    TOL,
    _reference,
    _run,
    test_a_prompt_longer_than_an_mlp_tile_matches_transformers,
    test_bf16_close_to_f32,
    test_chunks_through_kv_match,
    test_logits_of_some_tokens_match,
    test_packed_rows_equal_rows_alone,
    test_token_by_token_through_kv_matches,
    test_whole_prompt_matches_transformers,
)
from .test_quant import decode_both_ways

SLIDING, FULL = "sliding_attention", "full_attention"
BASE = {"tie_word_embeddings": True, "sliding_window": 4, "layer_types": [SLIDING, FULL], "query_pre_attn_scalar": 24, "max_position_embeddings": 256}
CASES = {
    "gemma3": BASE,
    # heads of 64 (the bf16 attention's and the chunk kernel's), global RoPE scaled, three layers, untied head
    "gemma3-d64": BASE | {"head_dim": 64, "num_hidden_layers": 3, "layer_types": [SLIDING, FULL, SLIDING], "tie_word_embeddings": False,
                          "rope_parameters": {FULL: {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}, SLIDING: {"rope_type": "default", "rope_theta": 1e4}}},
    "gemma3-capped": BASE | {"final_logit_softcapping": 0.5},  # a cap below the logits' size: it shows
}


@pytest.fixture(scope="module", params=list(CASES))
def pair(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    hf_dir, hf_model = write_tiny_hf(d / "hf", "gemma3", **CASES[request.param])
    out = convert(hf_dir, d / "tiny.jlm", "f32")
    return load_model(out.path, max_seq=128), hf_model


def test_the_window_is_shorter_than_the_prompt(pair):
    loaded, _ = pair
    assert len(PROMPT) > 2 * loaded.model.cfg.sliding_window  # so the window matters in the parity tests below


def test_a_long_generation_keeps_only_the_window_in_local_layers(pair, monkeypatch):
    """90 tokens one at a time, and in chunks: sliding layers hold at most two pages, letting go of the first once no
    query sees it, and the logits stay transformers'; global layers keep everything."""
    monkeypatch.setattr(kv_module, "_REWIND", 2)
    loaded, hf = pair
    cfg = loaded.model.cfg
    ids = [(7 * i + 3) % 90 + 3 for i in range(90)]
    ref = _reference(hf, ids)
    for chunks in ([[t] for t in ids], [ids[:9], ids[9:10], ids[10:30]] + [[t] for t in ids[30:60]] + [ids[60:]]):
        kv, out, longest = loaded.new_kv(), [], 0
        for part in chunks:
            out.append(loaded.runner.forward(torch.tensor(part), torch.arange(kv.length, kv.length + len(part)), [RowSpan(0, len(part), kv)]))
            longest = max(longest, len(part))
            for i in range(cfg.num_layers):
                if cfg.window(i) is not None:  # the page a query sees and the one being written
                    assert kv.layer_nbytes(i) <= 2 * PAGE * kv.bytes_per_position() // cfg.num_layers
        assert (torch.cat(out) - ref).abs().max().item() <= TOL
        sliding = [i for i in range(cfg.num_layers) if cfg.window(i) is not None]
        kv.reserve(kv.length + 1)  # as the next token's step does: the sliding layers let go first
        assert all(kv.start(i) == PAGE for i in sliding) and all(kv.start(i) == 0 for i in range(cfg.num_layers) if i not in sliding)
        assert all(kv.layer_nbytes(i) < kv.layer_nbytes(j) for i in sliding for j in range(cfg.num_layers) if j not in sliding)
        dropped = min(kv.start(i) for i in sliding)  # a session rewound to before its window's first kept key cannot go on
        assert kv.reusable(len(ids) - 1) == len(ids) - 1 and kv.reusable(dropped + cfg.sliding_window - 2) == 0


def test_config_and_norms_as_stored(pair):
    """The .jlm keeps each norm as the 1 + w it multiplies by, in f32, and the layer pattern and both thetas."""
    loaded, hf = pair
    jlm = JLMFile(loaded.path)
    config = jlm.config
    assert config["layer_types"] == list(hf.config.layer_types) and config["sliding_window"] == 4
    assert (config["rope_theta"], config["rope_local_theta"], config["query_pre_attn_scalar"]) == (1e6, 1e4, 24.0)
    norm = jlm.tensor("blocks.0.pre_feedforward_layernorm.weight")
    assert norm.dtype == torch.float32
    assert torch.equal(norm, 1 + hf.model.layers[0].pre_feedforward_layernorm.weight.detach())


MIX = {"attn_q": "Q8_0", "attn_k": "Q8_0", "attn_v": "Q5_0", "attn_output": "Q4_0", "ffn_gate": "Q5_0", "ffn_up": "Q5_0", "ffn_down": "Q4_0", "token_embd": "Q8_0"}


@pytest.mark.parametrize("quant", [None, MIX])
def test_from_gguf_as_llama_cpp_writes_it(tmp_path, quant):
    """llama.cpp's gemma3 names, norms stored as 1 + w, the per-layer pattern in its metadata: f32 matches
    transformers; kept quantized (Q8_0/Q4_0/Q5_0 rows, a Q8_0 table) it stays near."""
    hf_dir, hf = write_tiny_hf(tmp_path / "hf", "gemma3", **BASE | {"query_pre_attn_scalar": 16})  # llama.cpp's: head_dim
    path = write_tiny_gguf(tmp_path / "tiny.gguf", hf_dir, hf, arch="gemma3", quant=quant)
    f32 = load_model(convert(path, tmp_path / "f32.jlm", "f32").path, max_seq=64)
    assert f32.model.cfg.layer_types == (SLIDING, FULL)
    feeds = [PROMPT[:5]] + [[t] for t in PROMPT[5:]]
    if quant is None:
        assert (_run(f32, feeds) - _reference(hf, PROMPT)).abs().max().item() <= TOL
        return
    kept = load_model(convert(path, tmp_path / "kept.jlm").path, max_seq=64)  # the rows as stored, against them dequantized
    assert {e["type"] for e in JLMFile(kept.path).meta["quantization"].values()} == {"Q8_0", "Q5_0", "Q4_0"}
    want = _run(f32, feeds)
    assert (_run(kept, feeds) - want).abs().max().item() <= 0.03 * want.abs().max().item()


# Gemma 3's chat template, as google/gemma-3-*-it ship it (tokenizer_config.json)
GEMMA_TEMPLATE = (
    "{{ bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' -%}\n"
    "    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}\n"
    "    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}\n"
    "    {%- endif -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n"
    "{%- else -%}\n"
    "    {%- set first_user_prefix = \"\" -%}\n"
    "    {%- set loop_messages = messages -%}\n"
    "{%- endif -%}\n"
    "{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    "        {{ raise_exception(\"Conversation roles must alternate user/assistant/user/assistant/...\") }}\n"
    "    {%- endif -%}\n"
    "    {%- if (message['role'] == 'assistant') -%}\n"
    "        {%- set role = \"model\" -%}\n"
    "    {%- else -%}\n"
    "        {%- set role = message['role'] -%}\n"
    "    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n"
    "        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n"
    "        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'image' -%}\n"
    "                {{ '<start_of_image>' }}\n"
    "            {%- elif item['type'] == 'text' -%}\n"
    "                {{ item['text'] | trim }}\n"
    "            {%- endif -%}\n"
    "        {%- endfor -%}\n"
    "    {%- else -%}\n"
    "        {{ raise_exception(\"Invalid content type\") }}\n"
    "    {%- endif -%}\n"
    "    {{ '<end_of_turn>\\n' }}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "    {{'<start_of_turn>model\\n'}}\n"
    "{%- endif -%}\n"
)
GEMMA_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]  # Gemma's order (pad 0, eos 1, bos 2)


@pytest.fixture(scope="module")
def instruct(tmp_path_factory):
    """A tiny Gemma 3 instruct checkpoint as a Hugging Face directory: Gemma's specials and chat template, its
    generation config ending on <end_of_turn> too."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    d = tmp_path_factory.mktemp("gemma3-it")
    hf_dir, hf = write_tiny_hf(d / "hf", "gemma3", **BASE)
    vocab = {t: i for i, t in enumerate(GEMMA_SPECIALS)}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet())[: 96 - len(vocab)]:
        vocab.setdefault(ch, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(GEMMA_SPECIALS)
    (hf_dir / "tokenizer.json").write_text(tok.to_str())
    (hf_dir / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<bos>", "eos_token": "<eos>", "add_bos_token": True, "chat_template": GEMMA_TEMPLATE}))
    (hf_dir / "generation_config.json").write_text(json.dumps({"bos_token_id": 2, "eos_token_id": [1, 5]}))
    return convert(hf_dir, d / "models" / "gemma3-it.jlm", "f32").path


def test_an_instruct_checkpoint_chats_through_its_own_template(instruct):
    """Its template renders as transformers' does (system folded into the first user turn, `model` turns), the
    rendered <bos> is not doubled, and <end_of_turn> ends a reply."""
    from transformers import PreTrainedTokenizerFast

    loaded = load_model(instruct, max_seq=64)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " hi "}, {"role": "assistant", "content": "yo"},
                {"role": "user", "content": "again"}]
    text = loaded.chat.render(messages, add_generation_prompt=True)
    assert text == "<bos><start_of_turn>user\nBe brief.\n\nhi<end_of_turn>\n<start_of_turn>model\nyo<end_of_turn>\n<start_of_turn>user\nagain<end_of_turn>\n<start_of_turn>model\n"
    reference = PreTrainedTokenizerFast(tokenizer_file=str(instruct.parent.parent / "hf" / "tokenizer.json"), bos_token="<bos>", eos_token="<eos>")
    reference.chat_template = GEMMA_TEMPLATE
    assert text == reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = loaded.tokenizer.encode(text)
    assert ids[:2] == [2, 4] and ids.count(2) == 1
    assert set(loaded.eos_token_ids) == {1, 5}


def test_serve_chats_with_the_instruct_checkpoint_and_refuses_chat_on_a_base_model(instruct, gemma_base_dir):
    """`serve` on both: the OpenAI SDK's chat on the instruct one; on the base one (no template) chat is a clear 400
    and completions answer."""
    import subprocess
    import sys

    import openai

    from .serving import InProcessServer

    server = InProcessServer("-models", str(gemma_base_dir), "-load", "gemma3-it.jlm", "-id", "it")  # its own: the test loads base into it
    try:
        addr = server.url.removeprefix("http://")
        subprocess.run([sys.executable, "-m", "jitllmd", "models", "-load", "base.jlm", "-id", "base", "-addr", addr], check=True, capture_output=True)
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x")
        reply = client.chat.completions.create(model="it", messages=[{"role": "user", "content": "hi"}], max_tokens=5, temperature=0)
        # <bos> <start_of_turn> u s e r \n h i <end_of_turn> \n <start_of_turn> m o d e l \n: the template's tokens
        assert reply.choices[0].finish_reason in ("stop", "length") and reply.usage.prompt_tokens == 18
        with pytest.raises(openai.BadRequestError, match="no chat template"):
            client.chat.completions.create(model="base", messages=[{"role": "user", "content": "hi"}], max_tokens=5)
        done = client.completions.create(model="base", prompt="abc", max_tokens=4, temperature=0)
        assert done.usage.completion_tokens == 4 or done.choices[0].finish_reason == "stop"
    finally:
        server.stop()


@pytest.fixture(scope="module")
def gemma_base_dir(instruct, tmp_path_factory):
    """-models for the serve test: the instruct model and a base one (the same weights, its template taken away)."""
    import shutil

    models = instruct.parent
    hf = instruct.parent.parent / "hf"
    base_hf = tmp_path_factory.mktemp("gemma3-base") / "hf"
    shutil.copytree(hf, base_hf)
    import json

    cfg = json.loads((base_hf / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (base_hf / "tokenizer_config.json").write_text(json.dumps(cfg))
    convert(base_hf, models / "base.jlm", "f32")
    return models


@pytest.mark.parametrize("cache", [False, True])
def test_a_session_goes_on_past_its_window_and_rewinds_where_it_can(tiny_gemma_jlm, monkeypatch, cache):
    """A named session 140 tokens past a window of 8 (its sliding layer holding about the window and a chunk): a next
    turn reuses the whole cached prefix; a turn that rewinds behind what the sliding layer still holds is fed again
    from the start, or with the prefix cache from the start of the first page it entered (the cache keeps that page's
    sliding K/V). Both give the tokens of a fresh session fed the same prompt whole."""
    from jitllmd.engine.engine import Engine
    from jitllmd.engine.request import Delta
    from jitllmd.engine.sampler import SamplingParams

    monkeypatch.setattr(kv_module, "_REWIND", 2)
    greedy = SamplingParams(temperature=0)

    def turn(engine, session, prompt):
        events = list(engine.generate(Generation(prompt, greedy, max_tokens=40, session=session, ignore_eos=True)))
        return [t for ev in events if isinstance(ev, Delta) for t in ev.token_ids], events[-1]

    engine = Engine.load(tiny_gemma_jlm, max_seq=512, prefix_cache=cache)
    try:
        session = engine.new_session()
        first, _ = turn(engine, session, [5, 17, 23, 42, 7] * 20)
        assert session.kv.start(0) == 2 * PAGE and session.kv.layer_nbytes(0) <= session.kv.layer_nbytes(1) // 2  # let go of what it may
        history = list(session.token_ids)
        on, done = turn(engine, session, history + [9, 31])
        assert done.fed_tokens == 2  # the whole prefix reused
        back, done = turn(engine, session, history[:60] + [11, 70])
        assert done.fed_tokens == (2 if cache else 62)  # behind the window's kept keys: fed again, or the cache's 60
        for prompt, want in ((history + [9, 31], on), (history[:60] + [11, 70], back)):
            assert turn(engine, engine.new_session(), prompt)[0] == want
    finally:
        engine.stop()


def test_soft_capped_attention_matches_eager_attention_with_its_cap(tmp_path, monkeypatch):
    """A config that caps attention's scores (attn_logit_softcapping, as Gemma 2's do): ours against transformers'
    eager attention told the cap (its Gemma 3 module does not pass it on), whole prompt and token by token."""
    import functools

    import transformers.models.gemma3.modeling_gemma3 as modeling

    hf_dir, hf = write_tiny_hf(tmp_path / "hf", "gemma3", **BASE | {"attn_logit_softcapping": 0.5})
    loaded = load_model(convert(hf_dir, tmp_path / "capped.jlm", "f32").path, max_seq=64)
    assert loaded.model.cfg.attn_logit_softcapping == 0.5
    hf.config._attn_implementation = "eager"
    monkeypatch.setattr(modeling, "eager_attention_forward", functools.partial(modeling.eager_attention_forward, softcap=0.5))
    ref = _reference(hf, PROMPT)
    monkeypatch.undo()
    assert (ref - _reference(hf, PROMPT)).abs().max().item() > 10 * TOL  # the cap matters here
    assert (_run(loaded, [PROMPT]) - ref).abs().max().item() <= TOL
    assert (_run(loaded, [PROMPT[:5]] + [[t] for t in PROMPT[5:]]) - ref).abs().max().item() <= TOL


@pytest.mark.parametrize("variant", kernels.variants())
def test_a_quantized_layer_in_one_call_is_the_layer_call_by_call(tiny_gemma_q8_jlm, variant) -> None:
    """Gemma's decode rows kept quantized run each layer in one kernel call (layer.c, with the q/k norms, the
    sublayers' output norms and gelu): the same bits as its kernel calls from Python, for one row and for rows of
    several sessions packed, past the sliding window."""
    kernels.use_variant(variant)
    try:
        # the first session's rows go past the window of 8
        together, apart = decode_both_ways(load_model(tiny_gemma_q8_jlm, max_seq=64), list(range(3, 60)), 12)
        assert torch.equal(together.view(torch.int32), apart.view(torch.int32))
    finally:
        kernels.use_variant(None)
