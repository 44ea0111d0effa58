"""Build a Hugging Face `tokenizers.Tokenizer` from the vocabulary stored in a GGUF file."""

from __future__ import annotations

import bisect
import itertools
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import BPE

from ..models.family import SentencePieceQuirks

if TYPE_CHECKING:
    import gguf

    from .gguf_reader import GGUFFile

__all__ = ["GGUFTokenizer", "tokenizer_from_gguf"]

_SUPPORTED_MODELS = ("gpt2", "llama")

# llama.cpp token types (tokenizer.ggml.token_type).
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6

_SPACE = "\u2581"  # SentencePiece's visible space, "▁"

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_UPPER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]"
_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_CONTRACTION = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
_GPT4O_SPLIT = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTION}"
    rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_CONTRACTION}"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# tokenizer.ggml.pre -> split regex applied before byte-level mapping. Any other value (gpt-2,
# default, smollm, starcoder, ...) gets ByteLevel's built-in GPT-2 regex, as transformers does.
_PRE_SPLITS: dict[str, str] = {
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
         "jina-v5-nano", "dbrx", "smaug-bpe"),
        _LLAMA3_SPLIT,
    ),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), _QWEN2_SPLIT),
    "qwen35": _QWEN35_SPLIT,
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _GPT4O_SPLIT),
    "tekken": _TEKKEN_SPLIT,
}


@dataclass(frozen=True)
class GGUFTokenizer:
    """A serialized tokenizer plus the special-token settings a GGUF file declares."""

    tokenizer_json: str
    bos_token: str | None
    eos_token: str | None
    unk_token: str | None
    pad_token: str | None
    eos_token_ids: list[int]
    add_bos_token: bool
    add_eos_token: bool
    chat_template: str | None
    tokenizer: Tokenizer | None = field(default=None, repr=False, compare=False)  # tokenizer_json, built


def _field(reader: GGUFFile | gguf.GGUFReader, key: str, default: Any = None) -> Any:
    entry = reader.fields.get(key)
    return default if entry is None else entry.contents()


def _byte_to_char() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in kept}
    shifted = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + shifted)
            shifted += 1
    return table


def _derive_merges(vocab: dict[str, int], priority: dict[str, float]) -> list[tuple[str, str]]:
    """Merges implied by a vocabulary: every split of a token into two tokens, best token first.

    Ties go to the longer left part, then to file order, which is what transformers does.
    """
    ranks = list(priority.values())
    if len(set(ranks)) == len(ranks) and not any(r != r for r in ranks):
        # No two tokens rank alike (nor as NaN): the order below is each token's splits, longest left part first,
        # best token first; built without a sort key per split, a third faster on Gemma's 515k
        order = sorted(vocab, key=priority.__getitem__, reverse=True)
        return [(left, right) for token in order for cut in range(len(token) - 1, 0, -1)
                if (left := token[:cut]) in vocab and (right := token[cut:]) in vocab]
    ranked: list[tuple[float, int, int, int, str, str]] = []
    for token, token_id in vocab.items():
        size = len(token)
        for cut in range(1, size):
            left = token[:cut]
            if left in vocab and (right := token[cut:]) in vocab:
                ranked.append((-priority[token], -cut, cut - size, token_id, left, right))
    ranked.sort()  # (token_id, cut) is unique, so the strings never decide the order
    return [(left, right) for *_, left, right in ranked]


def _file_merges(merges: list[str], vocab: dict[str, int]) -> list[tuple[str, str]]:
    # A merge whose parts are not tokens would make the BPE model refuse to load.
    return [(left, right) for left, sep, right in (merge.partition(" ") for merge in merges)
            if sep and left in vocab and right in vocab and left + right in vocab]


def _add_vocab_tokens(tokenizer: Tokenizer, vocab: dict[str, int], tokens: list[str], types: list[int],
                      special_ids: set[int]) -> None:
    """Make control/unknown tokens special and user-defined ones plain added tokens, matched whole."""
    special, plain = [], []
    n = min(len(tokens), len(types))
    marked = [i for i, kind in enumerate(types[:n]) if kind in (_CONTROL, _UNKNOWN, _USER_DEFINED)]
    for i in sorted({*marked, *(i for i in special_ids if i < n)}):  # the few tokens that can be added, in order
        token, kind = tokens[i], types[i]
        if vocab.get(token) != i:
            continue  # duplicate or respelled spelling: not a whole token of the text
        if kind in (_CONTROL, _UNKNOWN) or i in special_ids:
            special.append(AddedToken(token, normalized=False, special=True))
        elif kind == _USER_DEFINED:
            plain.append(AddedToken(token, normalized=False, special=False))
    tokenizer.add_special_tokens(special)
    tokenizer.add_tokens(plain)


def _outside(tokens: list[str], alphabet: set[str]) -> list[int]:
    """The indices of the tokens with a character outside `alphabet`: one regex pass over them all, joined."""
    outside = re.compile("[^" + "".join(re.escape(c) for c in sorted(alphabet)) + "]")
    ends = list(itertools.accumulate(map(len, tokens)))  # token i's characters end at ends[i] in the joined text
    return sorted({bisect.bisect_right(ends, m.start()) for m in outside.finditer("".join(tokens))})


def _byte_level(tokens: list[str], types: list[int], merges: list[str] | None, pre: str | None,
                special_ids: set[int]) -> Tokenizer:
    """GPT-2 style byte-level BPE."""
    spell = _byte_to_char()
    spelled = tokens[: len(types)]
    for i in _outside(spelled, set(spell.values())):
        # Added tokens keep their raw text so they match in the input; a normal token outside the
        # byte alphabet is re-spelled so BPE can reach it.
        whole = types[i] in (_CONTROL, _USER_DEFINED, _UNKNOWN) or i in special_ids
        if not whole:
            spelled[i] = "".join(spell[b] for b in spelled[i].encode("utf-8"))
    vocab = dict(zip(spelled, range(len(spelled))))
    if merges is None:
        pairs = _derive_merges(vocab, {t: -i for t, i in vocab.items()})
    else:
        pairs = _file_merges(merges, vocab)
    tokenizer = Tokenizer(BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    split = _PRE_SPLITS.get(pre or "")
    if split is None:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    tokenizer.decoder = decoders.ByteLevel()
    _add_vocab_tokens(tokenizer, vocab, tokens, types, special_ids)
    return tokenizer


def _sentencepiece(tokens: list[str], types: list[int], scores: list[float], quirks: SentencePieceQuirks,
                   add_space_prefix: bool, unk_token: str | None, special_ids: set[int]) -> Tokenizer:
    """SentencePiece-style BPE: merges ranked by score, byte fallback, "▁" for spaces."""
    spelled = tokens
    if quirks.literal_spaces:
        spelled = [_SPACE * len(t) if t and not t.strip(" ") else t for t in tokens]
    vocab = dict(zip(spelled, range(len(spelled))))
    if quirks.ranked_by_position:
        priority = {token: -float(i) for token, i in vocab.items()}
    else:
        priority = {token: float(scores[i]) for token, i in vocab.items()}
    model = BPE(vocab=vocab, merges=_derive_merges(vocab, priority), unk_token=unk_token,
                fuse_unk=True, byte_fallback=True)
    tokenizer = Tokenizer(model)
    if quirks.always_prepends_space and add_space_prefix:
        tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend(_SPACE), normalizers.Replace(" ", _SPACE)])
    else:
        # "first": "▁" goes before the start of the text only, and not when the text already starts
        # with a space. That is transformers' behaviour; sentencepiece and llama.cpp always add one.
        scheme = "first" if add_space_prefix else "never"
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement=_SPACE, prepend_scheme=scheme, split=False)
    steps = [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    tokenizer.decoder = decoders.Sequence(steps)
    _add_vocab_tokens(tokenizer, vocab, tokens, types, special_ids)
    return tokenizer


def _post_processor(bos: tuple[str, int] | None, eos: tuple[str, int] | None) -> processors.TemplateProcessing:
    head = f"{bos[0]}:0 " if bos else ""
    tail = f" {eos[0]}:0" if eos else ""
    single = f"{head}$A:0{tail}"
    pair = f"{single}{' ' + bos[0] + ':1' if bos else ''} $B:1{' ' + eos[0] + ':1' if eos else ''}"
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=[t for t in (bos, eos) if t])


def tokenizer_from_gguf(reader: GGUFFile | gguf.GGUFReader, quirks: SentencePieceQuirks | None = None) -> GGUFTokenizer:
    """Rebuild the tokenizer described by a GGUF file's `tokenizer.*` metadata; `quirks`: how the file's family
    spells a SentencePiece vocabulary (its GGUFSource says)."""
    model = _field(reader, "tokenizer.ggml.model")
    if model not in _SUPPORTED_MODELS:
        raise ValueError(
            f"unsupported GGUF tokenizer.ggml.model {model!r}; supported: {', '.join(_SUPPORTED_MODELS)}"
        )
    tokens: list[str] | None = _field(reader, "tokenizer.ggml.tokens")
    if not tokens:
        raise ValueError("GGUF file has no vocabulary (tokenizer.ggml.tokens is missing or empty)")
    n_vocab = len(tokens)
    types: list[int] = _field(reader, "tokenizer.ggml.token_type") or [_NORMAL] * n_vocab

    def token_id(name: str) -> int | None:
        value = _field(reader, f"tokenizer.ggml.{name}_token_id")
        return int(value) if value is not None and 0 <= int(value) < n_vocab else None

    ids = {name: token_id(name) for name in ("bos", "eos", "unknown", "padding", "eot", "eom")}
    special_ids = {i for i in ids.values() if i is not None}
    text = {name: tokens[i] if i is not None else None for name, i in ids.items()}

    if model == "gpt2":
        tokenizer = _byte_level(tokens, types, _field(reader, "tokenizer.ggml.merges"),
                                _field(reader, "tokenizer.ggml.pre"), special_ids)
    else:
        scores = _field(reader, "tokenizer.ggml.scores") or [0.0] * n_vocab
        tokenizer = _sentencepiece(tokens, types, scores, quirks or SentencePieceQuirks(),
                                   bool(_field(reader, "tokenizer.ggml.add_space_prefix", True)),
                                   text["unknown"], special_ids)

    add_bos = bool(_field(reader, "tokenizer.ggml.add_bos_token", model == "llama"))
    add_eos = bool(_field(reader, "tokenizer.ggml.add_eos_token", False))
    bos_text, eos_text = text["bos"], text["eos"]
    bos = (bos_text, ids["bos"]) if add_bos and bos_text is not None and ids["bos"] is not None else None
    eos = (eos_text, ids["eos"]) if add_eos and eos_text is not None and ids["eos"] is not None else None
    if bos or eos:
        tokenizer.post_processor = _post_processor(bos, eos)

    eos_ids = list(dict.fromkeys(i for i in (ids["eos"], ids["eot"], ids["eom"]) if i is not None))
    return GGUFTokenizer(
        tokenizer_json=tokenizer.to_str(),
        bos_token=text["bos"],
        eos_token=text["eos"],
        unk_token=text["unknown"],
        pad_token=text["padding"],
        eos_token_ids=eos_ids,
        add_bos_token=add_bos,
        add_eos_token=add_eos,
        chat_template=_field(reader, "tokenizer.chat_template"),
        tokenizer=tokenizer,
    )
