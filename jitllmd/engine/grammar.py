"""Constrained sampling with llguidance: a JSON schema or a Lark grammar becomes a per-request matcher whose token mask
the sampler applies to its row's logits (bench/grammar_libs.py measured it against xgrammar: compiles in 1-3 ms against
30-60; a mask takes 0.02-0.06 ms at a JSON structure and 0.3-0.7 ms inside a long string on a 152k vocabulary, much
as xgrammar's; no dependencies)."""

from __future__ import annotations

import json
import re
import threading
from dataclasses import dataclass
from typing import Any

import torch

from .tokenizer import Tokenizer

__all__ = ["COMPACT_JSON", "Constraint", "GrammarError", "Grammars", "GrammarSpec"]

_PADDING = re.compile(r"\[PAD\d+\]")  # GGUF vocabularies pad to the embedding's rows with plain entries of this name
# each mask byte's 8 bits as what they add to a logit, 0 (allowed) or -inf: bit j of byte b is token 8b + j (the
# little-endian words of llguidance's mask). Adding these is branchless: ~0.1-0.2 ms over a 152k vocabulary, where a
# masked_fill by a dense, irregular boolean mask took 0.3-1.3 ms (bench/grammar.py).
_ADD = torch.where(((torch.arange(256).unsqueeze(-1) >> torch.arange(8)) & 1).bool(), 0.0, float("-inf"))
# JSON spaced as json.dumps spaces it: a small model cannot loop on whitespace (a schema's "x-guidance" takes it too)
COMPACT_JSON: Any = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """A schema or grammar llguidance cannot take: the message says why."""


@dataclass(frozen=True)
class GrammarSpec:
    """What a reply must be: JSON valid against `schema`, or a sentence of the Lark `lark` grammar."""

    schema: dict[str, Any] | None = None
    lark: str | None = None

    def __post_init__(self) -> None:
        if (self.schema is None) == (self.lark is None):
            raise ValueError("a grammar is a JSON schema or a Lark grammar")


class Grammars:
    """A model's grammar side: llguidance's tokenizer, built once on first use (a few seconds for a 152k vocabulary)
    from the model's tokenizer, with its ids up to the logits' `rows`."""

    def __init__(self, tokenizer: Tokenizer, rows: int):
        self._tokenizer = tokenizer
        self.rows = max(rows, tokenizer.vocab_size)
        self._llg: Any = None
        self._lock = threading.Lock()

    def _ll_tokenizer(self) -> Any:
        with self._lock:
            if self._llg is None:
                import llguidance

                doc = json.loads(self._tokenizer._backend.to_str())
                vocab = doc.get("model", {}).get("vocab")
                if isinstance(vocab, dict):  # padding entries stay ids, with no text, so no mask allows them
                    doc["model"]["vocab"] = {t: i for t, i in vocab.items() if not _PADDING.fullmatch(t)}
                self._llg = llguidance.LLTokenizer(json.dumps(doc), n_vocab=self.rows, eos_token=list(self._tokenizer.eos_token_ids))
            return self._llg

    def constraint(self, spec: GrammarSpec) -> Constraint:
        """A fresh matcher for one reply. GrammarError when the schema or grammar is not one llguidance takes."""
        import llguidance

        try:
            if spec.schema is not None:
                grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(spec.schema), defaults=COMPACT_JSON)
            else:
                grammar = llguidance.LLMatcher.grammar_from_lark(spec.lark or "")
        except (ValueError, TypeError) as exc:
            raise GrammarError(str(exc)) from None
        matcher = llguidance.LLMatcher(self._ll_tokenizer(), grammar)
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        return Constraint(matcher, self.rows)


class Constraint:
    """One reply's matcher: `mask` the logits before sampling, `accept` each sampled token; `done` once the grammar
    is complete (only end of sequence may follow). Used by the engine thread only."""

    def __init__(self, matcher: Any, rows: int):
        self.matcher = matcher
        self.rows = rows
        self._mask = torch.zeros((rows + 31) // 32, dtype=torch.int32)

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """f32 logits [V] with every token the grammar does not allow next at -inf (a copy)."""
        m = self._mask.numpy()
        self.matcher.unsafe_compute_mask_ptr(m.ctypes.data, m.nbytes)
        add = _ADD.index_select(0, self._mask.view(torch.uint8).int()).view(-1)[: logits.shape[-1]]
        return logits + add.to(logits.device)

    def accept(self, token: int) -> None:
        if not self.matcher.is_stopped():
            self.matcher.consume_token(token)

    @property
    def done(self) -> bool:
        return bool(self.matcher.is_stopped())
