"""Tool calls in a model's reply: Hermes <tool_call> blocks and bare JSON calls, found while the reply streams."""

from __future__ import annotations

import json
import re
from collections.abc import Collection
from dataclasses import dataclass
from enum import Enum
from typing import Any

__all__ = ["Piece", "Text", "ToolCall", "ToolCallParser", "complete_members", "parse_pieces", "parse_reply"]

OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"
MISTRAL_PREFIX = "[TOOL_CALLS]"
FENCE = "```"
# A Markdown fence that may hold a call: ``` or ```json, then the end of its line.
_FENCE_HEADER = re.compile(r"```(?:json)?[ \t\r]*\n", re.IGNORECASE)
_FENCE_HEADER_START = re.compile(r"`{1,3}|```(?:j|js|jso|(?:json)?[ \t\r]*)", re.IGNORECASE)
# The start of a call cut short: its name (whole, closed) and, when it has begun, where its arguments' value starts.
_PARTIAL_CALL = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"(\s*,\s*"(?:arguments|parameters)"\s*:\s*)?', re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    """A call to a declared tool; arguments is the JSON text of its arguments object. A call the reply's end cut short
    (max_tokens) is not `complete`: its arguments are the text generated so far, maybe not JSON yet (as OpenAI
    returns such a call)."""

    name: str
    arguments: str
    complete: bool = True


@dataclass(frozen=True)
class Text:
    """Ordinary reply text."""

    text: str


Piece = Text | ToolCall


class _State(Enum):
    OPENING = "opening"  # only whitespace and calls so far: a bare call, fence or [TOOL_CALLS] may start here
    TEXT = "text"  # prose has been released: only a <tool_call> tag starts a call now
    BLOCK = "block"  # inside a <tool_call> block, waiting for its close tag
    BARE = "bare"  # reading a bare JSON call (maybe fenced, maybe after [TOOL_CALLS]) to its end


class ToolCallParser:
    """Streams a model's reply, separating ordinary text from tool calls to the declared tools.

    Recognised: Hermes `<tool_call>{json}</tool_call>` blocks anywhere (one left unclosed counts when the
    reply ends or the next block opens, if its JSON parses); and, while only whitespace and calls precede
    it, a bare JSON call or list of calls, the same inside a ``` or ```json fence, or `[TOOL_CALLS]` and a
    list. A call is `{"name": ..., "arguments" | "parameters": {...}}` naming a declared tool; anything else
    is text, released unchanged.

    Whitespace: the whitespace after a call (up to the next other character) belongs to the call and is
    dropped, as is whitespace opening the reply when a call follows it. Whitespace before a call in the
    middle of text is kept. Nothing else is dropped.
    """

    def __init__(self, tool_names: Collection[str]):
        self._names = frozenset(tool_names)
        self._buf = ""  # input not yet released as text or consumed by a call
        self._state = _State.OPENING
        self._resume = _State.OPENING  # where a call returns to: OPENING until any text is released
        self._trim = False  # drop the whitespace at the front of _buf: it follows a call
        self._start = 0  # BLOCK: where the tag starts in _buf; BARE: where to look for the JSON value
        self._tag_from = 0  # BLOCK: where to look for the next tag
        self._fenced = False  # BARE: the JSON sits in a fence that must close
        self._value_start = -1  # BARE: where the JSON value starts in _buf, once it looks like a call
        self._value_end = -1  # BARE: just past the JSON value, once it has closed
        self._pos = 0  # BARE: how far the bracket scan has read
        self._depth = 0
        self._in_str = False
        self._esc = False
        self._cut = False  # finish(cut=True): an open call was cut short

    @property
    def held(self) -> str:
        """Text held back right now because it is, or may be becoming, a call."""
        return self._buf

    def feed(self, text: str) -> list[Piece]:
        """Add text from the model; returns the pieces that are certain now."""
        if not self._names:  # nothing can be a call
            return [Text(text)] if text else []
        self._buf += text
        return self._advance(final=False)

    def finish(self, cut: bool = False) -> list[Piece]:
        """The reply has ended: returns everything still held, as calls or text. `cut`: max_tokens ended it, so a
        call still open is a call cut short, returned as one (not complete) where its tool's name was generated, and
        never as text."""
        self._cut = cut
        return self._advance(final=True)

    def _advance(self, final: bool) -> list[Piece]:
        out: list[Piece] = []
        step = {_State.OPENING: self._opening, _State.TEXT: self._text, _State.BLOCK: self._block, _State.BARE: self._bare}
        while True:
            if self._trim:
                self._buf = self._buf.lstrip()
                if not self._buf:
                    break
                self._trim = False
            if not step[self._state](out, final):  # each step returns False when it needs more input
                break
        return _merge(out)

    def _opening(self, out: list[Piece], final: bool) -> bool:
        s = self._buf.lstrip()
        ws = len(self._buf) - len(s)
        if not s:
            return final and self._to_text()
        if s.startswith(OPEN_TAG):
            self._state, self._start, self._tag_from = _State.BLOCK, ws, ws + len(OPEN_TAG)
            return True
        if s.startswith(MISTRAL_PREFIX):
            return self._to_bare(ws + len(MISTRAL_PREFIX), fenced=False)
        if m := _FENCE_HEADER.match(s):
            return self._to_bare(ws + m.end(), fenced=True)
        if not final and (OPEN_TAG.startswith(s) or MISTRAL_PREFIX.startswith(s) or _FENCE_HEADER_START.fullmatch(s)):
            return False  # still undecided: "<tool", "[", "```js"
        if self._cut and OPEN_TAG.startswith(s):  # a tag cut short: the call it opened never came
            self._buf = ""
            return False
        if s[0] in "{[":
            return self._to_bare(ws, fenced=False)
        return self._to_text()

    def _text(self, out: list[Piece], final: bool) -> bool:
        i = self._buf.find(OPEN_TAG)
        if i >= 0:
            out.append(Text(self._buf[:i]))
            self._buf = self._buf[i:]
            self._state, self._start, self._tag_from = _State.BLOCK, 0, len(OPEN_TAG)
            return True
        keep = _tag_prefix_len(self._buf) if not final or self._cut else 0  # "<tool" may become the tag; "<toolbox" may not
        cut = len(self._buf) - keep
        out.append(Text(self._buf[:cut]))
        self._buf = "" if final else self._buf[cut:]  # a tag cut short at the end opened no call
        return False

    def _block(self, out: list[Piece], final: bool) -> bool:
        body = self._start + len(OPEN_TAG)
        while True:
            close = self._buf.find(CLOSE_TAG, self._tag_from)
            reopen = self._buf.find(OPEN_TAG, self._tag_from)
            if reopen >= 0 and (close < 0 or reopen < close):
                # A block opening before this one closed: this one was left unclosed, a call if it parses.
                # If it does not parse, the tag may sit inside its JSON, so keep looking for the close.
                if calls := _calls(self._buf[body:reopen], self._names):
                    return self._emit(out, calls, reopen)
                self._tag_from = reopen + len(OPEN_TAG)
                continue
            if close >= 0:
                end = close + len(CLOSE_TAG)
                calls = _calls(self._buf[body:close], self._names)
                return self._emit(out, calls, end) if calls else self._release(out, end)
            break
        if not final:
            self._tag_from = max(self._tag_from, len(self._buf) - len(CLOSE_TAG))
            return False
        calls = _calls(self._buf[body:], self._names)  # unclosed at the end of the reply
        if not calls and self._cut:
            return self._emit(out, _cut_calls(self._buf[body:], self._names), len(self._buf))
        return self._emit(out, calls, len(self._buf)) if calls else self._release(out, len(self._buf))

    def _bare(self, out: list[Piece], final: bool) -> bool:
        if self._value_start < 0:
            rest = self._buf[self._start :].lstrip()
            looks = _looks_like_call(rest)
            if looks is None and not final:
                return False
            if not looks:
                return self._to_text()
            self._value_start = self._pos = len(self._buf) - len(rest)
        if self._value_end < 0:
            self._scan()
            if self._value_end < 0 and final and self._cut:
                source = self._buf[self._value_start :]
                calls = _cut_calls(source, self._names)
                if calls or _may_open_call(source, self._names):  # else JSON that is no call, cut short: text
                    return self._emit(out, calls, len(self._buf))
            if self._value_end < 0:
                return final and self._to_text()
        calls = _calls(self._buf[self._value_start : self._value_end], self._names)
        if not calls:
            return self._to_text()
        end = self._value_end
        if self._fenced:
            tail = self._buf[end:].lstrip()
            if tail.startswith(FENCE):
                end = len(self._buf) - len(tail) + len(FENCE)
            elif FENCE.startswith(tail) and final:
                end = len(self._buf)  # the fence never closed, but the call is whole: count it, like an unclosed block
            elif FENCE.startswith(tail):
                return False
            else:
                return self._to_text()
        return self._emit(out, calls, end)

    def _scan(self) -> None:
        """Reads on from _pos to where the JSON value's outer bracket closes, skipping brackets inside strings."""
        buf = self._buf
        for i in range(self._pos, len(buf)):
            c = buf[i]
            if self._in_str:
                if self._esc:
                    self._esc = False
                elif c == "\\":
                    self._esc = True
                elif c == '"':
                    self._in_str = False
            elif c == '"':
                self._in_str = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self._value_end = i + 1
                    return
        self._pos = len(buf)

    def _to_bare(self, value_from: int, fenced: bool) -> bool:
        self._state, self._start, self._fenced = _State.BARE, value_from, fenced
        self._value_start = self._value_end = -1
        self._pos, self._depth, self._in_str, self._esc = 0, 0, False, False
        return True

    def _to_text(self) -> bool:
        """What is held is not a call: it is released as text, and bare calls no longer count."""
        self._state = self._resume = _State.TEXT
        return True

    def _emit(self, out: list[Piece], calls: list[ToolCall], end: int) -> bool:
        """_buf[:end] was calls (with any whitespace before them); whitespace after them goes too."""
        out.extend(calls)
        self._buf = self._buf[end:]
        self._state, self._trim = self._resume, True
        return True

    def _release(self, out: list[Piece], end: int) -> bool:
        out.append(Text(self._buf[:end]))
        self._buf = self._buf[end:]
        return self._to_text()


def parse_pieces(text: str, tool_names: Collection[str], cut: bool = False) -> list[Piece]:
    """The whole reply at once, as text and calls in the order they were generated (`cut`: see finish)."""
    parser = ToolCallParser(tool_names)
    return _merge(parser.feed(text) + parser.finish(cut))


def parse_reply(text: str, tool_names: Collection[str], cut: bool = False) -> tuple[str, list[ToolCall]]:
    """The whole reply at once: (the text that is not a call, the calls in order)."""
    pieces = parse_pieces(text, tool_names, cut)
    return "".join(p.text for p in pieces if isinstance(p, Text)), [p for p in pieces if isinstance(p, ToolCall)]


def complete_members(arguments: str) -> dict[str, Any]:
    """The members of a JSON object cut short that were whole before the cut ({} when none were): what can stand for
    a cut call's input where an object is required (Anthropic's tool_use)."""
    try:
        value = json.loads(arguments)
        return value if isinstance(value, dict) else {}
    except ValueError:
        pass
    depth, in_str, esc, best = 0, False, False, {}
    for i, c in enumerate(arguments):
        if in_str:
            esc, in_str = (False, True) if esc else (c == "\\", c != '"')
            continue
        if c == '"':
            in_str = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
        elif c == "," and depth == 1:  # a top-level member ends here
            try:
                value = json.loads(arguments[:i] + "}")
            except ValueError:
                continue
            if isinstance(value, dict):
                best = value
    return best


def _cut_calls(source: str, names: frozenset[str]) -> list[ToolCall]:
    """The calls in JSON text that max_tokens cut short: the whole calls of a list, then the cut one when its name is
    a declared tool's (its arguments as far as they came)."""
    rest = source.strip()
    rest = rest[: len(rest) - _tag_prefix_len(rest, CLOSE_TAG)].rstrip()  # cut inside the close tag: what it closes may be whole
    if calls := _calls(rest, names):
        return calls
    if rest.startswith("["):  # a list of calls: the whole ones first
        decoder, pos = json.JSONDecoder(), 1
        while True:
            while pos < len(rest) and rest[pos] in " \t\r\n,":
                pos += 1
            try:
                item, pos = decoder.raw_decode(rest, pos)
            except ValueError:
                break
            if (call := _call(item, names)) is None:
                return calls
            calls.append(call)
        rest = rest[pos:]
    rest = rest.lstrip()
    m = _PARTIAL_CALL.match(rest)
    if m and m.group(1) in names:
        calls.append(ToolCall(m.group(1), rest[m.end() :] if m.group(2) else "", complete=False))
    return calls


def _looks_like_call(s: str) -> bool | None:
    """Whether s can open a call's JSON (an object with keys, or a list of objects); None while it cannot tell."""
    if not s:
        return None
    if s[0] not in "{[":
        return False
    inner = s[1:].lstrip()
    if not inner:
        return None
    return inner[0] in ('"}' if s[0] == "{" else "{")


def _calls(source: str, names: frozenset[str]) -> list[ToolCall]:
    """The calls that JSON text makes (an object or a list of them), or [] unless every one is a declared call."""
    try:
        value = json.loads(source)
    except ValueError:
        return []
    items = value if isinstance(value, list) else [value]
    calls = [_call(item, names) for item in items]
    return [c for c in calls if c is not None] if calls and None not in calls else []


def _call(item: Any, names: frozenset[str]) -> ToolCall | None:
    if not isinstance(item, dict) or not isinstance(item.get("name"), str) or item["name"] not in names:
        return None
    args = item["arguments"] if "arguments" in item else item.get("parameters")
    if args is None:
        args = {}
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(item["name"], json.dumps(args, ensure_ascii=False))


def _may_open_call(source: str, names: frozenset[str]) -> bool:
    """Whether JSON text cut short may still have been a call to a declared tool: `{"name": "get_w` may; `{"city"`
    may not."""
    s = source.lstrip()
    if s.startswith("["):
        s = s[1:].lstrip()
    if not s.startswith("{"):
        return not s
    s = s[1:].lstrip()
    key = '"name"'
    if len(s) <= len(key):
        return key.startswith(s)
    if not s.startswith(key):
        return False
    s = s[len(key) :].lstrip()
    if s[:1] not in ("", ":"):
        return False
    s = s[1:].lstrip()
    if s[:1] not in ("", '"'):
        return False
    fragment = s[1:]
    return "\"" not in fragment and any(n.startswith(fragment) for n in names)  # a whole name was _cut_calls' to find


def _tag_prefix_len(s: str, tag: str = OPEN_TAG) -> int:
    """Length of the longest end of s that begins `tag` (without being all of it)."""
    for k in range(min(len(tag) - 1, len(s)), 0, -1):
        if s.endswith(tag[:k]):
            return k
    return 0


def _merge(pieces: list[Piece]) -> list[Piece]:
    """Joins neighbouring text and drops empty text."""
    out: list[Piece] = []
    for p in pieces:
        if isinstance(p, Text):
            if not p.text:
                continue
            if out and isinstance(out[-1], Text):
                out[-1] = Text(out[-1].text + p.text)
                continue
        out.append(p)
    return out
