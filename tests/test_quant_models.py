"""The real models kept quantized: SmolLM2-135M (its Q4_1 + Q8_0 GGUF) and Qwen2.5-Coder-0.5B-Instruct Q4_K_M (Q5_0,
Q8_0, Q4_K, Q6_K) against the same engine on the same weights dequantized to f32 (SmolLM2's f32 .jlm; for Qwen the
quantized projections' torch reference, which dequantizes each one per call: no 2 GB f32 file to write), and their
memory."""

from __future__ import annotations

import math
import subprocess
import sys
from contextlib import contextmanager, nullcontext

import pytest
import torch

from jitllmd.engine.convert import convert
from jitllmd.engine.engine import Engine
from jitllmd.engine.jlm import JLMFile
from jitllmd.engine.kernels.ops import bf16_units
from jitllmd.engine.kv import RowSpan
from jitllmd.engine.layers import quant
from jitllmd.engine.loader import load_model
from jitllmd.engine.request import Delta, Generation
from jitllmd.engine.sampler import SamplingParams

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
TEXT = (
    "The history of the printing press begins in the fifteenth century, when movable type changed how books were made. "
    "Before it, scribes copied every page by hand, and a single volume could take months. Paper mills spread along the "
    "rivers of Europe, and merchants carried the new books to fairs in distant cities, where scholars argued about them. "
)


@pytest.fixture(scope="module")
def smol_kept(tmp_path_factory, smollm2_gguf):
    return convert(smollm2_gguf, tmp_path_factory.mktemp("smolq") / "smollm2.jlm").path  # auto: kept quantized


def _greedy(path, n: int = 32, prompt_chunk: int = 512) -> tuple[list[int], str]:
    loaded = load_model(path, max_seq=512)
    prompt = loaded.tokenizer.encode(loaded.chat.render(QUESTION, add_generation_prompt=True))
    e = Engine(loaded, prompt_chunk=prompt_chunk).start()
    try:
        events = list(e.generate(Generation(prompt, SamplingParams(temperature=0), max_tokens=n)))
    finally:
        e.stop()
    deltas = [ev for ev in events if isinstance(ev, Delta)]
    return [i for d in deltas for i in d.token_ids], "".join(d.text for d in deltas)


@contextmanager
def _reference():
    """Quantized projections built within it run layers/quant.py's reference: each segment dequantized to f32 per call,
    then F.linear (the model's weights in f32, no kernel of their own)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(quant, "rows_kernel", lambda: None)
        yield


def _teacher_forced(path, ids: list[int], chunk: int, reference: bool = False) -> torch.Tensor:
    """Logits at every position of `ids`, fed `chunk` tokens a step (<= 16: the kernels' few-row path); `reference`:
    through the quantized projections' f32 reference."""
    with _reference() if reference else nullcontext():
        loaded = load_model(path, max_seq=len(ids) + 1)
        kv, out = loaded.new_kv(), []
        for at in range(0, len(ids), chunk):
            part = ids[at : at + chunk]
            out.append(loaded.runner.forward(torch.tensor(part), torch.arange(at, at + len(part)), [RowSpan(0, len(part), kv)]))
    return torch.cat(out)


def _agreement(kept, f32, text: str, n: int = 256) -> float:
    """Teacher-forced top-1 agreement of `kept` (8 tokens a step) with `f32` (a .jlm, or None: kept's weights through
    the f32 reference), over n tokens of text."""
    ids = load_model(kept, max_seq=8).tokenizer.encode(text * 4)[:n]
    assert len(ids) == n
    a, b = _teacher_forced(kept, ids, 8), _teacher_forced(f32 or kept, ids, n, reference=f32 is None)
    return (a.argmax(-1) == b.argmax(-1)).float().mean().item()


def test_smollm2_kept_quantized_answers_as_its_f32_weights(smol_kept, smollm2_jlm) -> None:
    """The Q4_1 blocks (and the Q8_0 table) as stored: greedy 32 tokens equal to the dequantized f32 model's where a
    prompt's products round x to bf16. Where they round it to int8 per 32 inputs (the int8 GEMM: llama.cpp's
    rounding), the prompt's last position is a near tie that goes the other way, as it does for llama.cpp: its
    llama-server answers "L'Étoile, la Marseillaise, la femme au roi, ..." from this GGUF (2026-12-02), and so does
    this engine, the prompt fed whole or a token a step (a 135M model's later near ties may part them after a dozen
    tokens: the prompt's attention sums in another order)."""
    assert {e["type"] for e in JLMFile(smol_kept).meta["quantization"].values()} == {"Q4_1", "Q8_0"}
    ids, text = _greedy(smol_kept)
    if bf16_units() is not None:
        want_ids, want_text = _greedy(smollm2_jlm)
        assert text == want_text == "The capital of France is Paris."
        assert ids == want_ids
    else:
        stepped = _greedy(smol_kept, prompt_chunk=1)[1]
        assert text.startswith("L'Étoile, la Marseillaise, la") and stepped.startswith("L'Étoile, la Marseillaise, la"), (text, stepped)


def test_smollm2_teacher_forced_top1_agrees(smol_kept, smollm2_jlm) -> None:
    assert _agreement(smol_kept, smollm2_jlm, TEXT) >= 0.97


def test_qwen_q4_k_m_kept_quantized(qwen_jlm) -> None:
    """Q5_0, Q8_0, Q4_K and Q6_K rows, q/k/v of mixed types in one projection: the greedy answer is the f32 weights'
    (each of its tokens the f32 model's top-1 after the same prefix, all 32 fed at once), and teacher-forced top-1
    agrees at >= 97% of 256 positions."""
    quant = JLMFile(qwen_jlm).meta["quantization"]
    assert {e["type"] for e in quant.values()} == {"Q5_0", "Q8_0", "Q4_K", "Q6_K"}
    ids, text = _greedy(qwen_jlm)
    loaded = load_model(qwen_jlm, max_seq=8)
    prompt = loaded.tokenizer.encode(loaded.chat.render(QUESTION, add_generation_prompt=True))
    f32 = _teacher_forced(qwen_jlm, prompt + ids, len(prompt) + len(ids), reference=True)
    assert "Paris" in text and f32[len(prompt) - 1 : -1].argmax(-1).tolist() == ids
    assert _agreement(qwen_jlm, None, TEXT) >= 0.97


def _peak_rss_mb(code: str) -> float:
    """Peak RSS of a fresh Python process running `code`, in MB: its VmHWM, which starts afresh at exec (ru_maxrss
    would carry this test process's own peak into the child forked from it)."""
    script = code + "\nprint([line for line in open('/proc/self/status') if line.startswith('VmHWM')][0])"
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    lines = [line for line in out.stdout.splitlines() if line.startswith("VmHWM")]
    assert lines, out.stderr[-2000:]
    return int(lines[-1].split()[1]) / 1024  # kB


def test_kept_quantized_memory_is_about_the_file(qwen_jlm) -> None:
    """A generation's peak RSS, less what an engine process holds before loading anything, stays near the file's
    size (weights as stored, plus KV and working buffers), far under the f32 weights' bytes alone (4 per weight, of
    every quantized tensor's shape: what an f32 model must hold)."""
    load = "from jitllmd.engine.loader import load_model; from jitllmd.engine.engine import Engine; "
    base = _peak_rss_mb(load + "import torch; torch.ones(1) @ torch.ones(1)")
    run = load + (
        "from jitllmd.engine.request import Generation; from jitllmd.engine.sampler import SamplingParams; m = load_model({!r}, max_seq=256); e = Engine(m).start(); "
        "list(e.generate(Generation(m.tokenizer.encode('Write a haiku about memory.'), SamplingParams(temperature=0), max_tokens=16))); e.stop()"
    )
    kept = _peak_rss_mb(run.format(str(qwen_jlm))) - base
    size = qwen_jlm.stat().st_size / 2**20
    f32 = sum(4 * math.prod(e["shape"]) for e in JLMFile(qwen_jlm).meta["quantization"].values()) / 2**20
    assert kept <= 1.3 * size + 64, (kept, size, base)
    assert kept < f32 / 3, (kept, f32)
