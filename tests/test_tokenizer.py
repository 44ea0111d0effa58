"""Tests for jitllmd.engine.tokenizer: BOS handling, special tokens, and exact incremental detokenizing."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, pre_tokenizers, processors

from jitllmd.engine.tokenizer import Detokenizer, Tokenizer

BOS, EOS = 1, 2  # SmolLM2: <|im_start|>, <|im_end|>

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "Emoji: 🙂👍🏽 family 👨‍👩‍👧‍👦 flag 🇯🇵 done",
    "中文测试：你好，世界！日本語のテキスト。한국어 텍스트.",
    "Accents: café naïve résumé Ærøskøbing Ångström; combining: e\u0301 n\u0303",
    'def f(x: int) -> dict[str, int]:\n    return {"x": x ** 2}  # tab\there\n\n',
    "  leading spaces, trailing spaces  ",
    "العربية עברית Ελληνικά Русский हिन्दी ไทย",
    "math ∑∫√∞ ≠ ≤ ≥ → ⇒ ∀x∃y and symbols ©®™ €£¥",
]
CHAR_POOL = "abcXYZ019 ,.\n\t-_=éüßñ中文字日本語한국🙂👍🏽🇯🇵∑→€"


def _random_texts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(CHAR_POOL) for _ in range(rng.randint(1, 40))) for _ in range(n)]


def _stream(tok: Tokenizer, ids: list[int], **kwargs: object) -> tuple[list[str], str]:
    detok = tok.detokenizer(**kwargs)
    deltas = [detok.add(i) for i in ids]
    tail = detok.flush()
    assert detok.text == "".join(deltas) + tail
    return deltas, tail


def _assert_streams_exactly(tok: Tokenizer, ids: list[int], *, skip_special_tokens: bool = True) -> None:
    deltas, tail = _stream(tok, ids, skip_special_tokens=skip_special_tokens)
    expected = tok.decode(ids, skip_special_tokens=skip_special_tokens)
    assert "".join(deltas) + tail == expected
    if "\ufffd" not in expected:
        assert not any("\ufffd" in delta for delta in deltas)
        assert tail == ""


# --- SmolLM2: byte-level BPE (gpt2 style) -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2_hf(smollm2_hf_tokenizer):
    return smollm2_hf_tokenizer


@pytest.fixture(scope="module")
def smollm2_json(smollm2_hf) -> str:
    return smollm2_hf.backend_tokenizer.to_str()


@pytest.fixture(scope="module")
def smollm2(smollm2_json: str) -> Tokenizer:
    return Tokenizer(smollm2_json, bos_token_id=BOS, eos_token_ids=[EOS], add_bos_token=False)


def test_smollm2_basics(smollm2: Tokenizer, smollm2_hf) -> None:
    assert smollm2.vocab_size == 49152
    assert smollm2.id_to_token(BOS) == "<|im_start|>"
    assert smollm2.id_to_token(EOS) == "<|im_end|>"
    assert smollm2.decode([BOS, EOS], skip_special_tokens=True) == ""  # both are special
    assert smollm2.eos_token_ids == (EOS,)
    for text in TEXTS:
        ids = smollm2.encode(text)
        assert ids == smollm2_hf.encode(text, add_special_tokens=False)
        assert smollm2.decode(ids) == text


def test_special_tokens_encode_as_single_ids(smollm2: Tokenizer) -> None:
    chat = "<|im_start|>system\nBe nice.<|im_end|>\n<|im_start|>user\nHi 🙂<|im_end|>\n<|im_start|>assistant\n"
    ids = smollm2.encode(chat)
    assert ids[0] == BOS
    assert ids.count(BOS) == 3 and ids.count(EOS) == 2
    pieces = [smollm2.id_to_token(i) for i in ids]
    assert "<|im_start|>" in pieces and not any("im_start" in p and p != "<|im_start|>" for p in pieces)
    assert smollm2.decode(ids, skip_special_tokens=False) == chat
    assert smollm2.decode(ids) == "system\nBe nice.\nuser\nHi 🙂\nassistant\n"


def test_smollm2_never_double_bos(smollm2_json: str) -> None:
    tok = Tokenizer(smollm2_json, bos_token_id=BOS, eos_token_ids=[EOS], add_bos_token=True)
    plain = tok.encode("hello")
    assert plain[0] == BOS and plain[1] != BOS
    chat = tok.encode("<|im_start|>user\nhello")
    assert chat[0] == BOS and chat[1] != BOS
    assert tok.encode("hello", add_special_tokens=False)[0] != BOS
    assert plain[1:] == tok.encode("hello", add_special_tokens=False)


def test_smollm2_streaming_is_exact(smollm2: Tokenizer) -> None:
    split_chars = 0
    for text in TEXTS + _random_texts(60, seed=1):
        ids = smollm2.encode(text)
        split_chars += sum("\ufffd" in smollm2.decode([i]) for i in ids)
        _assert_streams_exactly(smollm2, ids)
    assert split_chars > 10, "the texts must exercise characters split across tokens"


def test_smollm2_streaming_holds_back_partial_characters(smollm2: Tokenizer) -> None:
    ids = smollm2.encode("👨‍👩‍👧‍👦")
    assert len(ids) > 4
    deltas, tail = _stream(smollm2, ids)
    assert "" in deltas and tail == ""
    assert all(delta.encode("utf-8").decode("utf-8") == delta for delta in deltas)


def test_smollm2_streaming_with_special_tokens(smollm2: Tokenizer) -> None:
    ids = [*smollm2.encode("<|im_start|>assistant\n"), *smollm2.encode("Sure — 中文 🙂!"), EOS]
    for skip in (True, False):
        _assert_streams_exactly(smollm2, ids, skip_special_tokens=skip)
    deltas, _ = _stream(smollm2, ids, skip_special_tokens=False)
    assert deltas[-1] == "<|im_end|>"


def test_smollm2_streaming_random_ids(smollm2: Tokenizer) -> None:
    # Arbitrary ids, invalid UTF-8 included: the stream still adds up to decode(ids).
    rng = random.Random(7)
    for _ in range(40):
        ids = [rng.randrange(smollm2.vocab_size) for _ in range(rng.randint(1, 30))]
        deltas, tail = _stream(smollm2, ids)
        assert "".join(deltas) + tail == smollm2.decode(ids)


def test_streaming_window_stays_small(smollm2: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    sizes: list[int] = []
    original = Detokenizer._decode

    def counting(self: Detokenizer, ids: list[int]) -> str:
        sizes.append(len(ids))
        return original(self, ids)

    monkeypatch.setattr(Detokenizer, "_decode", counting)
    ids = smollm2.encode(" ".join(TEXTS) * 10)
    assert len(ids) > 1000
    _assert_streams_exactly(smollm2, ids)
    assert max(sizes) <= 12, max(sizes)
    assert len(sizes) <= 2 * len(ids) + 2


# --- SentencePiece style: Metaspace + byte fallback -------------------------------------------------------------


def _sentencepiece_json(*, bos_post_processor: bool) -> str:
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for byte in range(256):
        vocab[f"<0x{byte:02X}>"] = len(vocab)
    for char in "▁abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,!?'-:;()\néü文":
        vocab.setdefault(char, len(vocab))
    merges = []
    for word in ["▁the", "▁hello", "▁world", "ing", "▁café", "▁文", "▁▁", "▁time", "▁upon", "▁a"]:
        piece = word[0]
        for char in word[1:]:
            if piece + char not in vocab:
                merges.append((piece, char))
                vocab[piece + char] = len(vocab)
            piece += char
    backend = Backend(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    backend.add_special_tokens(["<unk>", "<s>", "</s>"])
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    if bos_post_processor:
        backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return backend.to_str()


@pytest.fixture(scope="module")
def spm() -> Tokenizer:
    source = _sentencepiece_json(bos_post_processor=False)
    return Tokenizer(source, bos_token_id=1, eos_token_ids=[2], add_bos_token=True)


def _is_byte_token(token_id: int) -> bool:
    return 3 <= token_id < 3 + 256


def test_sentencepiece_encode_decode(spm: Tokenizer) -> None:
    ids = spm.encode("the café 中文 🙂", add_special_tokens=False)
    assert any(_is_byte_token(i) for i in ids), "中 and 🙂 are only reachable by byte fallback"
    assert spm.id_to_token(ids[0]) == "▁the"
    assert spm.decode(ids) == "the café 中文 🙂"


def test_sentencepiece_bos(spm: Tokenizer) -> None:
    assert spm.encode("hello")[:2] == [1, spm.encode("hello", add_special_tokens=False)[0]]
    assert spm.encode("<s>hello").count(1) == 1
    assert 1 not in spm.encode("hello", add_special_tokens=False)
    with_post = _sentencepiece_json(bos_post_processor=True)
    for add_bos in (True, False):
        tok = Tokenizer(with_post, bos_token_id=1, eos_token_ids=[2], add_bos_token=add_bos)
        for text in ("hello", "<s>hello", "<s> hello world"):
            ids = tok.encode(text)
            assert ids[0] == 1 and ids[1] != 1, (add_bos, text, ids)
        assert tok.encode("hello", add_special_tokens=False)[0] != 1


def test_sentencepiece_streaming_is_exact(spm: Tokenizer) -> None:
    texts = [*TEXTS, "中", "🙂 at start", " the hello world", "hello  world   ", "文中文中"]
    for text in texts + _random_texts(60, seed=2):
        ids = spm.encode(text)
        _assert_streams_exactly(spm, ids)
        _assert_streams_exactly(spm, [*ids, 2], skip_special_tokens=False)


def test_sentencepiece_streaming_byte_fallback(spm: Tokenizer) -> None:
    ids = spm.encode("a中b", add_special_tokens=False)
    assert [spm.id_to_token(i) for i in ids] == ["▁a", "<0xE4>", "<0xB8>", "<0xAD>", "b"]
    deltas, tail = _stream(spm, ids)
    assert deltas == ["a", "", "", "中", "b"] and tail == ""


def test_sentencepiece_leading_space_mid_stream(spm: Tokenizer) -> None:
    # SentencePiece drops the leading space of the first token only; mid-stream spaces must survive.
    ids = spm.encode("hello world the time", add_special_tokens=False)
    deltas, _ = _stream(spm, ids)
    assert deltas[0] == "hello" and all(delta.startswith(" ") for delta in deltas[1:] if delta)


def test_detokenizer_context(spm: Tokenizer) -> None:
    prompt = spm.encode("once upon a", add_special_tokens=False)
    full = spm.encode("once upon a time", add_special_tokens=False)
    generated = full[len(prompt) :]
    assert spm.decode(generated) == "time"  # alone, the space is stripped ...
    detok = spm.detokenizer(context=prompt)
    assert "".join(detok.add(i) for i in generated) + detok.flush() == " time"  # ... in context it is not


def test_flush_emits_incomplete_bytes(spm: Tokenizer) -> None:
    ids = spm.encode("a中", add_special_tokens=False)[:-1]  # cut inside 中
    detok = spm.detokenizer()
    assert [detok.add(i) for i in ids] == ["a", "", ""]
    assert detok.flush() == spm.decode(ids)[1:]
    assert "\ufffd" in detok.text
    assert detok.flush() == ""


def test_bad_construction(spm: Tokenizer) -> None:
    source = _sentencepiece_json(bos_post_processor=False)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        Tokenizer(source, bos_token_id=1, eos_token_ids=[10**6], add_bos_token=False)
    with pytest.raises(ValueError, match="no bos_token_id"):
        Tokenizer(source, bos_token_id=None, eos_token_ids=[2], add_bos_token=True)
    with pytest.raises(ValueError, match="invalid tokenizer JSON"):
        Tokenizer("{not json", bos_token_id=None, eos_token_ids=[], add_bos_token=False)
