"""Tokenizer wrapper over Hugging Face `tokenizers`, with BOS handling and incremental (streaming) detokenizing."""

from __future__ import annotations

import functools
from collections.abc import Iterable

from tokenizers import Tokenizer as _Backend

__all__ = ["Detokenizer", "Tokenizer"]

_REPLACEMENT = "\ufffd"
# Context tokens kept in front of a stream so its first token decodes with the right leading space.
_CONTEXT_TOKENS = 6
# A valid UTF-8 character spans a few tokens at most; past this many held tokens the bytes are invalid for good.
_MAX_PENDING = 32
# A text longer than this many characters per token of room is counted a piece at a time before it is encoded whole,
# stopping once it surely makes too many tokens: tokenizing costs per character, and a huge prompt that cannot fit
# costs only what fits. Pieces end at whitespace where they can; each cut may add a few tokens the whole would not
# have, which the count takes off.
_COUNT_PAST = 8
_PIECE = 16384
_CUT_TOKENS = 4


class Tokenizer:
    """A `tokenizer.json` tokenizer plus the model's BOS/EOS facts (which GGUF keeps outside the JSON)."""

    def __init__(
        self, tokenizer_json: str, *, bos_token_id: int | None, eos_token_ids: list[int], add_bos_token: bool
    ):
        try:
            self._backend = _Backend.from_str(tokenizer_json)
        except Exception as exc:
            raise ValueError(f"invalid tokenizer JSON: {exc}") from exc
        size = self.vocab_size
        for name, token_id in [("bos_token_id", bos_token_id), *(("eos_token_ids", i) for i in eos_token_ids)]:
            if token_id is not None and not 0 <= token_id < size:
                raise ValueError(f"{name} {token_id} is outside the vocabulary (size {size})")
        if add_bos_token and bos_token_id is None:
            raise ValueError("add_bos_token is set but there is no bos_token_id")
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(eos_token_ids)
        self.add_bos_token = add_bos_token
        self._special_ids = frozenset(
            token_id for token_id, token in self._backend.get_added_tokens_decoder().items() if token.special
        )

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    @functools.cached_property
    def most_chars_per_token(self) -> int:
        """At most this many characters of text make one token: the longest vocabulary string (a byte-level
        token's string has a character per byte; a text character is at least one byte), or the longest word
        WordPiece turns into a single unknown token."""
        most = max((len(t) for t in self._backend.get_vocab(with_added_tokens=True)), default=1)
        model = self._backend.model
        if type(model).__name__ == "WordPiece":
            most = max(most, int(getattr(model, "max_input_chars_per_word", 100)))
        return max(1, most)

    def token_id(self, token: str) -> int | None:
        """The id of a vocabulary string (e.g. "<tool_call>"), or None if there is no such token."""
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary string of `token_id` (e.g. "<|im_end|>"), or None if there is no such id."""
        return self._backend.id_to_token(token_id)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; special-token strings in it (e.g. "<|im_start|>") become their single ids."""
        encoding = self._backend.encode(text, add_special_tokens=add_special_tokens)
        ids = encoding.ids
        bos = self.bos_token_id
        if not add_special_tokens or bos is None:
            return ids
        if len(ids) >= 2 and ids[0] == ids[1] == bos and encoding.special_tokens_mask[0]:
            # The post-processor added a BOS in front of one the text (a rendered chat template) already has.
            return ids[1:]
        if self.add_bos_token and ids[:1] != [bos]:
            return [bos, *ids]
        return ids

    def count_past(self, text: str, most: int) -> int | None:
        """A lower bound on the tokens `text` makes, when it is surely more than `most`: found a piece at a time,
        so a text far too long for `most` costs about `most` tokens' worth of work; None when it may fit."""
        if len(text) <= max(_PIECE, _COUNT_PAST * most):
            return None  # encoding it whole costs no more than the prompt it may be
        total = cuts = start = 0
        while start < len(text):
            end = min(len(text), start + _PIECE)
            if end < len(text):
                space = max(text.rfind(c, start + _PIECE // 2, end) for c in " \n\t")
                end = space if space > start else end
            total += len(self._backend.encode(text[start:end], add_special_tokens=False).ids)
            cuts += 1
            if total - _CUT_TOKENS * cuts > most:
                return total - _CUT_TOKENS * cuts
            start = end
        return None

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = True) -> str:
        """Text of `ids`; ids outside the vocabulary are ignored."""
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def detokenizer(self, *, skip_special_tokens: bool = True, context: list[int] | None = None) -> Detokenizer:
        """A fresh streaming decoder. `context`: ids before the stream (e.g. the prompt), never emitted themselves,
        so that the first token keeps the leading space it has mid-text (SentencePiece strips it at the start)."""
        return Detokenizer(self, skip_special_tokens=skip_special_tokens, context=context)


class Detokenizer:
    """Turns a stream of token ids into text deltas, never emitting a broken UTF-8 character."""

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = True, context: list[int] | None = None):
        self._backend = tokenizer._backend
        self._skip = skip_special_tokens
        self._skipped = tokenizer._special_ids if skip_special_tokens else frozenset()
        # A short window of ids: _ids[:_read] is already emitted and decodes to _prefix_text; the rest is held.
        # Decoding the window rather than one token at a time keeps decoder context (spaces, byte fallback,
        # multi-token characters) while costing O(window) per token.
        self._ids = [i for i in (context or ()) if i not in self._skipped][-_CONTEXT_TOKENS:]
        self._read = len(self._ids)
        self._prefix_text = self._decode(self._ids) if self._ids else ""
        self._parts: list[str] = []
        self._text: str | None = ""

    @property
    def text(self) -> str:
        """All text emitted so far."""
        if self._text is None:
            self._text = "".join(self._parts)
        return self._text

    def add(self, token_id: int) -> str:
        """Feed one id; return the text it completes ("" while a character is still incomplete)."""
        if token_id in self._skipped:
            # decode(skip_special_tokens=True) drops these before decoding, so leaving them out is exact.
            return ""
        self._ids.append(token_id)
        text = self._decode(self._ids)
        if len(text) <= len(self._prefix_text):
            return ""
        if text.endswith(_REPLACEMENT) and len(self._ids) - self._read < _MAX_PENDING:
            return ""
        return self._emit(text)

    def flush(self) -> str:
        """Emit whatever is still held at the end of the stream (incomplete bytes become U+FFFD)."""
        if self._read == len(self._ids):
            return ""
        text = self._decode(self._ids)
        if len(text) <= len(self._prefix_text):
            return ""
        return self._emit(text)

    def _emit(self, text: str) -> str:
        delta = text[len(self._prefix_text) :]
        # Slide the window: the ids just emitted become the context for the next ones.
        del self._ids[: self._read]
        self._read = len(self._ids)
        self._prefix_text = self._decode(self._ids)
        self._parts.append(delta)
        self._text = None
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self._backend.decode(ids, skip_special_tokens=self._skip)
