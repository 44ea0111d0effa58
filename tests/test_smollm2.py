"""SmolLM2-135M-Instruct end to end: our engine on the f32 .jlm against transformers on the same GGUF, and the CLI."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from jitllmd.engine.engine import Engine
from jitllmd.engine.loader import load_model
from jitllmd.engine.request import Delta, Done, FinishReason, Generation
from jitllmd.engine.sampler import SamplingParams

from .conftest import seeded_cache

pytestmark = pytest.mark.slow

QUESTION = "What is the capital of France?"
MESSAGES = [{"role": "user", "content": QUESTION}]
N = 32


@pytest.fixture(scope="module")
def reference(smollm2_hf_tokenizer, smollm2_hf_model):
    """transformers' tokenizer and model from the GGUF (dequantized to f32), the session's."""
    return smollm2_hf_tokenizer, smollm2_hf_model


@pytest.fixture(scope="module")
def loaded(smollm2_jlm):
    return load_model(smollm2_jlm, max_seq=512)


@pytest.fixture(scope="module")
def ours(loaded) -> tuple[list[int], list[int], str, Done]:
    """Our prompt ids and greedy continuation (ids, text, Done)."""
    prompt = loaded.tokenizer.encode(loaded.chat.render(MESSAGES, add_generation_prompt=True))
    e = Engine(loaded).start()
    try:
        events = list(e.generate(Generation(prompt, SamplingParams(temperature=0), max_tokens=N)))
    finally:
        e.stop()
    deltas = [ev for ev in events if isinstance(ev, Delta)]
    return prompt, [i for d in deltas for i in d.token_ids], "".join(d.text for d in deltas), events[-1]


def _reference_prompt(tok) -> list[int]:
    ids = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    if not isinstance(ids, list):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


def test_prompt_ids_match_transformers(reference, ours) -> None:
    tok, _ = reference
    prompt, *_ = ours
    assert prompt == _reference_prompt(tok)
    assert tok.decode(prompt).endswith("<|im_start|>assistant\n")


def test_greedy_matches_transformers(reference, loaded, ours) -> None:
    tok, model = reference
    prompt, ids, text, done = ours
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False, max_new_tokens=N, pad_token_id=tok.eos_token_id,
        )
    want = out[0, len(prompt):].tolist()
    eos = set(loaded.eos_token_ids)
    assert eos == {tok.eos_token_id}
    if want and want[-1] in eos:  # transformers keeps the EOS it stopped on; our output ends before it
        want = want[:-1]
        assert done.finish_reason is FinishReason.STOP and done.stop is None
    else:
        assert len(want) == N and done.finish_reason is FinishReason.LENGTH
    assert ids == want
    assert done.completion_tokens == len(ids)
    assert text == tok.decode(want, skip_special_tokens=True)


def test_answer_says_paris(ours) -> None:
    *_, text, _ = ours
    assert "Paris" in text


def test_cli_end_to_end(smollm2_jlm, tmp_path) -> None:
    p = subprocess.run(
        [sys.executable, "-m", "jitllmd", "run", "-model", str(smollm2_jlm), "-chat", "-n", str(N), "-temp", "0", QUESTION],
        cwd=tmp_path, env={**os.environ, "JITLLMD_CACHE": str(seeded_cache(tmp_path / "cache"))},
        capture_output=True, text=True, timeout=300,
    )
    assert p.returncode == 0, p.stderr
    assert "The capital of France is Paris." in p.stdout
    assert "Traceback" not in p.stderr


@pytest.fixture(scope="module")
def smollm2_bf16(tmp_path_factory, smollm2_gguf):
    from jitllmd.engine.convert import convert

    return convert(smollm2_gguf, tmp_path_factory.mktemp("smol-bf16") / "smollm2-bf16.jlm", "bf16").path


def test_bf16_answers_alike_whole_and_after_a_cached_prefix(smollm2_bf16, bf16_path) -> None:
    """On both bf16 paths (forced, whatever this CPU has), the greedy answer is the f32 model's, fed whole and fed
    again after the pooled slot's cached prefix (one token). A bf16 residual stream flipped the second one."""
    e = Engine.load(smollm2_bf16, max_seq=512)
    try:
        assert e.loaded.model.act == (torch.bfloat16 if bf16_path else torch.float32)
        prompt = e.loaded.tokenizer.encode(e.loaded.chat.render(MESSAGES, add_generation_prompt=True))
        answers, cached = [], []
        for _ in range(2):
            events = list(e.generate(Generation(prompt, SamplingParams(temperature=0), max_tokens=N)))
            answers.append("".join(ev.text for ev in events if isinstance(ev, Delta)))
            cached.append(events[-1].prompt_tokens - events[-1].fed_tokens)
        assert answers == ["The capital of France is Paris."] * 2 and cached == [0, len(prompt) - 1]
    finally:
        e.stop()
