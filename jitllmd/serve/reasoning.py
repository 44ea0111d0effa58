"""Reasoning models: the markers a thinking chat template writes (`<think>` ... `</think>`), found once per model; a
reply split into its thought and its answer, streamed or whole; and what a request asks of the thought (an effort,
a budget, thinking on or off) as the template's variables and the engine's per-row budget (sampler.Thinking)."""

from __future__ import annotations

import re
import threading
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..engine.catalog import ServedModel
from ..engine.chat import ChatTemplate, ChatTemplateError
from ..engine.loader import LoadedModel
from ..engine.sampler import Thinking
from ..engine.tokenizer import Tokenizer

__all__ = ["EFFORTS", "EFFORT_BUDGETS", "Markers", "Reasoning", "ReasoningSplitter", "Split", "detect_markers", "markers_of", "plan_reasoning",
           "prompt_opens", "split_reasoning"]

# The marker pairs templates write (Qwen3, QwQ, DeepSeek-R1 and its distills; Seed-OSS; Kimi), each one token of its
# vocabulary; and the template variables that switch thinking (Qwen3's enable_thinking, DeepSeek-V3.1's thinking).
_PAIRS = (("<think>", "</think>"), ("<seed:think>", "</seed:think>"), ("\u25c1think\u25b7", "\u25c1/think\u25b7"))
_SWITCHES = ("enable_thinking", "thinking")
_PROBE = [{"role": "user", "content": "x"}]
_ANSWER, _THOUGHT = "ANSWER", "THOUGHT"

EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")  # OpenAI's ReasoningEffort
# Tokens inside the thought each effort allows before its close marker is forced (None: unbounded). none and minimal
# turn thinking off (the template's switch; 0 ends a thought the model opens anyway at once). A small local model
# thinks at length: low and medium bound it where a client asks for less; high and above leave it to the model (and
# max_tokens).
EFFORT_BUDGETS: dict[str, int | None] = {"none": 0, "minimal": 0, "low": 512, "medium": 2048, "high": None, "xhigh": None, "max": None}
_TAIL = 4096  # a prompt whose open marker is further back than this many tokens is not in a thought (prompt_opens)


@dataclass(frozen=True)
class Markers:
    """A thinking model's thought markers, each one token its tokenizer decodes as text; `after`: what its template
    writes after the close marker ("\\n\\n" for Qwen3), as ids too; `switch`: the template variable that turns thinking
    off when false (Qwen3's `enable_thinking`), None where the template has none (DeepSeek-R1 always thinks)."""

    open: str
    close: str
    open_id: int
    close_id: int
    after: str = ""
    after_ids: tuple[int, ...] = ()
    switch: str | None = None


_found: weakref.WeakKeyDictionary[ChatTemplate, Markers | None] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def markers_of(model: LoadedModel | ServedModel) -> Markers | None:
    """The thought markers of a loaded model (or a served one), found once per model (detect_markers); None for a model
    that does not think: nothing of it changes."""
    loaded = model.engine.loaded if isinstance(model, ServedModel) else model
    with _lock:
        if loaded.chat in _found:
            return _found[loaded.chat]
        markers = _found[loaded.chat] = detect_markers(loaded.chat, loaded.tokenizer)
        return markers


def detect_markers(chat: ChatTemplate, tokenizer: Tokenizer) -> Markers | None:
    """A template that thinks names its close marker, and both markers are tokens of the vocabulary that decode as
    themselves (a special token the detokenizer drops could not be split out of the text). What the template writes
    after the close marker, and its switch, are read from what it renders for a probe conversation."""
    source = chat.source or ""
    for open_, close in _PAIRS:
        open_id, close_id = tokenizer.token_id(open_), tokenizer.token_id(close)
        if close not in source or open_id is None or close_id is None:
            continue
        if tokenizer.decode([open_id]) != open_ or tokenizer.decode([close_id]) != close:
            continue
        switch = _switch(chat, source)
        after = _after(chat, close, switch)
        return Markers(open_, close, open_id, close_id, after, tuple(tokenizer.encode(after, add_special_tokens=False)), switch)
    return None


def _render(chat: ChatTemplate, messages: list[dict[str, Any]], *, generation: bool = True, **extra: Any) -> str | None:
    try:
        return chat.render(messages, add_generation_prompt=generation, **extra)
    except ChatTemplateError:  # a template that wants more of a conversation than the probe: it has no say here
        return None


def _switch(chat: ChatTemplate, source: str) -> str | None:
    for name in _SWITCHES:
        if name in source:
            on, off = _render(chat, _PROBE, **{name: True}), _render(chat, _PROBE, **{name: False})
            if on is not None and off is not None and on != off:
                return name
    return None


def _after(chat: ChatTemplate, close: str, switch: str | None) -> str:
    """The whitespace after the close marker in the template's own writing: its empty thought (thinking off), or a past
    turn's thought (a message's reasoning_content); none where it writes neither."""
    turn = [*_PROBE, {"role": "assistant", "content": _ANSWER, "reasoning_content": _THOUGHT}]
    for text in (_render(chat, _PROBE, **{switch: False}) if switch else None, _render(chat, turn, generation=False)):
        if text and close in text:
            return re.match(r"\s*", text[text.rindex(close) + len(close):]).group(0)  # type: ignore[union-attr]
    return ""


def prompt_opens(markers: Markers, tokenizer: Tokenizer, prompt_ids: Sequence[int]) -> bool:
    """Whether a prompt ends inside a thought, so the reply starts in it: its last open marker comes after its last close
    marker, with no special token (a turn's marker) after it — a DeepSeek-R1 generation prompt's `<think>\\n`, or an
    assistant prefill that opened one; not a user who wrote `<think>` in a message."""
    ids = list(prompt_ids[-_TAIL:])
    if markers.open_id not in ids:
        return False
    at = len(ids) - 1 - ids[::-1].index(markers.open_id)
    tail = ids[at + 1 :]
    if markers.close_id in tail:
        return False
    return tokenizer.decode(tail, skip_special_tokens=True) == tokenizer.decode(tail, skip_special_tokens=False)


@dataclass(frozen=True)
class Split:
    """What a piece of a reply holds: its thought's text, then its answer's (a thought only ever comes first)."""

    reasoning: str = ""
    answer: str = ""


class ReasoningSplitter:
    """A reply's text deltas -> its thought's text and its answer's, as they stream. The thought is the reply's start:
    from the open marker that begins it (or from the first token, when the prompt opened it: `inside`) to the close
    marker; the answer is the rest, its leading newlines dropped (the templates write "</think>\\n\\n"), as vLLM's
    qwen3 reasoning parser does. A reply that does not begin with the open marker has no thought: all of it is the
    answer, unchanged. A marker cut across deltas is held back until it is whole; a thought never closed (max_tokens)
    is all reasoning."""

    def __init__(self, markers: Markers, *, inside: bool = False):
        self.markers = markers
        self.thought = inside  # a thought was opened, by the prompt or by the reply
        self.closed = False  # ... and closed
        self._answering = False  # past the thought (or with none): text is the answer's
        self._held = ""

    def feed(self, text: str) -> Split:
        """The next delta of the reply: what of it is the thought's and the answer's now (a part of a marker waits)."""
        return self._advance(self._held + text, final=False)

    def finish(self) -> Split:
        """The reply ended: whatever was held back."""
        return self._advance(self._held, final=True)

    def _advance(self, buf: str, final: bool) -> Split:
        self._held = ""
        reasoning = ""
        m = self.markers
        if not self.thought and not self._answering:  # the reply's start: a thought opens here or never
            if buf.startswith(m.open):
                self.thought, buf = True, buf[len(m.open):]
            elif m.open.startswith(buf) and not final:
                self._held = buf
                return Split()
            else:
                self._answering = True
        if self.thought and not self.closed:
            at = buf.find(m.close)
            if at < 0:
                keep = 0 if final else _overlap(buf, m.close)
                self._held = buf[len(buf) - keep:]
                return Split(buf[: len(buf) - keep])
            reasoning, buf = buf[:at], buf[at + len(m.close):]
            self.closed = True
        if self.closed and not self._answering:  # the newlines the template writes after the close marker
            buf = buf.lstrip("\n")
            self._answering = bool(buf)
        return Split(reasoning, buf)


def _overlap(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper start of `marker`."""
    for k in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


def split_reasoning(text: str, markers: Markers, *, inside: bool = False) -> tuple[str | None, str]:
    """A whole reply -> (its thought's text, None where it has no thought; its answer), as ReasoningSplitter splits it."""
    splitter = ReasoningSplitter(markers, inside=inside)
    first, last = splitter.feed(text), splitter.finish()
    return (first.reasoning + last.reasoning if splitter.thought else None), first.answer + last.answer


@dataclass(frozen=True)
class Reasoning:
    """What one request asks of a model's thought: `template_kwargs`, the chat template's extra variables (the client's
    own and the switch); `budget`, the tokens allowed inside the thought before its close marker is forced (0: thinking
    off; None: unbounded). `markers` None: a model that does not think (its template still takes the variables;
    nothing is split or enforced)."""

    markers: Markers | None = None
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    budget: int | None = None

    @property
    def thinks(self) -> bool:
        return self.markers is not None

    def inside(self, tokenizer: Tokenizer, prompt_ids: Sequence[int]) -> bool:
        """Whether this prompt (its ids, as rendered) opened the thought: the reply starts inside it (prompt_opens)."""
        return self.markers is not None and prompt_opens(self.markers, tokenizer, prompt_ids)

    def thinking(self, tokenizer: Tokenizer, prompt_ids: Sequence[int]) -> Thinking | None:
        """The engine's side for one prompt (Generation.thinking): it counts the reasoning tokens and enforces the
        budget; None for a model that does not think."""
        m = self.markers
        if m is None:
            return None
        return Thinking(m.open_id, m.close_id, m.after_ids, inside=self.inside(tokenizer, prompt_ids), budget=self.budget)

    def splitter(self, tokenizer: Tokenizer, prompt_ids: Sequence[int]) -> ReasoningSplitter | None:
        """A splitter for the reply to this prompt; None for a model that does not think."""
        if self.markers is None:
            return None
        return ReasoningSplitter(self.markers, inside=self.inside(tokenizer, prompt_ids))


def plan_reasoning(
    markers: Markers | None, *, effort: str | None = None, budget: int | None = None, enabled: bool | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
) -> Reasoning:
    """A request's thought from what it asks (each None: not asked): `effort` one of EFFORTS (also given to the template
    as `reasoning_effort`, which some templates read), `budget` tokens inside the thought (-1: unbounded; 0: none),
    `enabled` thinking on or off (Anthropic's `thinking`), and the client's own `template_kwargs`, applied last. Off
    (effort none or minimal, enabled false, budget 0, or the client's switch false) renders the template's switch
    false, where it has one, and makes the budget 0, so a thought the model opens anyway ends at once. An explicit
    budget overrides the effort's (EFFORT_BUDGETS). Asking nothing changes nothing: the template's default, no budget."""
    if effort is not None and effort not in EFFORT_BUDGETS:
        raise ValueError(f"reasoning effort {effort!r}: expected one of {', '.join(EFFORTS)}")
    client = dict(template_kwargs or {})
    limit = None if budget == -1 else budget
    if limit is None and budget is None and effort is not None:
        limit = EFFORT_BUDGETS[effort]
    off = enabled is False or (effort is not None and EFFORT_BUDGETS[effort] == 0) or budget == 0
    kwargs: dict[str, Any] = {"reasoning_effort": effort} if effort is not None else {}
    switch = markers.switch if markers is not None else None
    if switch is not None and (off or enabled is not None or effort is not None):
        kwargs[switch] = not off
    if switch is not None and switch in client and not client[switch]:
        off = True
    kwargs.update(client)
    return Reasoning(markers, kwargs, 0 if off else limit)
