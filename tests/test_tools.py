"""The tool-call parser: every scripted reply parsed whole, split in two at every point, and a character at a time."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import pytest

from jitllmd.serve.tools import Piece, Text, ToolCall, ToolCallParser, complete_members, parse_pieces, parse_reply

NAMES = {"get_weather", "search_web"}


def call(name: str, **args: object) -> ToolCall:
    return ToolCall(name, json.dumps(args, ensure_ascii=False))


PARIS = call("get_weather", city="Paris")
NEWS = call("search_web", query="latest news")
PARIS_JSON = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
NEWS_JSON = '{"name": "search_web", "arguments": {"query": "latest news"}}'
H_PARIS = f"<tool_call>\n{PARIS_JSON}\n</tool_call>"
H_NEWS = f"<tool_call>\n{NEWS_JSON}\n</tool_call>"


@dataclass
class Case:
    """A reply, and each call's source span (in order, whitespace it swallows included) with the calls it makes."""

    id: str
    reply: str
    spans: list[tuple[str, list[ToolCall]]] = field(default_factory=list)


def text_only(id: str, reply: str) -> Case:
    return Case(id, reply)


CASES = [
    # Hermes blocks
    Case("hermes", H_PARIS, [(H_PARIS, [PARIS])]),
    Case("hermes_tight", f"<tool_call>{PARIS_JSON}</tool_call>", [(f"<tool_call>{PARIS_JSON}</tool_call>", [PARIS])]),
    Case(
        "hermes_padded", f"<tool_call>\n\n  {PARIS_JSON}  \n\t</tool_call>", [(f"<tool_call>\n\n  {PARIS_JSON}  \n\t</tool_call>", [PARIS])]
    ),
    Case("hermes_leading_ws", f"\n\n{H_PARIS}", [(f"\n\n{H_PARIS}", [PARIS])]),
    Case("text_before_hermes", f"Let me check the weather.\n{H_PARIS}", [(H_PARIS, [PARIS])]),
    Case("hermes_trailing_text", f"{H_PARIS}\n\nChecking now.", [(f"{H_PARIS}\n\n", [PARIS])]),
    Case("hermes_trailing_ws", f"{H_PARIS}\n \n", [(f"{H_PARIS}\n \n", [PARIS])]),
    Case("two_hermes", f"{H_PARIS}\n{H_NEWS}", [(f"{H_PARIS}\n", [PARIS]), (H_NEWS, [NEWS])]),
    Case("two_hermes_tight", f"{H_PARIS}{H_NEWS}", [(H_PARIS, [PARIS]), (H_NEWS, [NEWS])]),
    Case(
        "hermes_between_prose",
        f"First {H_PARIS} then {H_NEWS} done.",
        [(f"{H_PARIS} ", [PARIS]), (f"{H_NEWS} ", [NEWS])],
    ),
    Case(
        "hermes_list",
        f"<tool_call>[{PARIS_JSON}, {NEWS_JSON}]</tool_call>",
        [(f"<tool_call>[{PARIS_JSON}, {NEWS_JSON}]</tool_call>", [PARIS, NEWS])],
    ),
    Case(
        "tag_inside_arguments",
        '<tool_call>{"name": "search_web", "arguments": {"query": "what is <tool_call>"}}</tool_call>',
        [
            (
                '<tool_call>{"name": "search_web", "arguments": {"query": "what is <tool_call>"}}</tool_call>',
                [call("search_web", query="what is <tool_call>")],
            )
        ],
    ),
    Case("crlf_fence", f"```json\r\n{PARIS_JSON}\r\n```\r\nDone.", [(f"```json\r\n{PARIS_JSON}\r\n```\r\n", [PARIS])]),
    Case("hermes_then_bare", f"{H_PARIS}\n{NEWS_JSON}", [(f"{H_PARIS}\n", [PARIS]), (NEWS_JSON, [NEWS])]),
    # arguments
    Case(
        "empty_arguments",
        '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>',
        [('<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>', [ToolCall("get_weather", "{}")])],
    ),
    Case(
        "missing_arguments",
        '<tool_call>{"name": "get_weather"}</tool_call>',
        [('<tool_call>{"name": "get_weather"}</tool_call>', [ToolCall("get_weather", "{}")])],
    ),
    Case(
        "arguments_as_string",
        '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}</tool_call>',
        [('<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}</tool_call>', [PARIS])],
    ),
    Case(
        "unicode_arguments",
        '<tool_call>{"name": "search_web", "arguments": {"query": "café 中文 🌧️"}}</tool_call>',
        [
            (
                '<tool_call>{"name": "search_web", "arguments": {"query": "café 中文 🌧️"}}</tool_call>',
                [call("search_web", query="café 中文 🌧️")],
            )
        ],
    ),
    Case(
        "escaped_unicode_arguments",
        '{"name": "search_web", "arguments": {"query": "caf\\u00e9"}}',
        [('{"name": "search_web", "arguments": {"query": "caf\\u00e9"}}', [call("search_web", query="café")])],
    ),
    Case(
        "brackets_in_strings",
        '{"name": "search_web", "arguments": {"query": "a } tricky \\" {[ string"}} after',
        [
            (
                '{"name": "search_web", "arguments": {"query": "a } tricky \\" {[ string"}} ',
                [call("search_web", query='a } tricky " {[ string')],
            )
        ],
    ),
    # bare JSON opening the reply
    Case("bare", PARIS_JSON, [(PARIS_JSON, [PARIS])]),
    Case(
        "bare_parameters",
        '{"name": "get_weather", "parameters": {"city": "Paris"}}',
        [('{"name": "get_weather", "parameters": {"city": "Paris"}}', [PARIS])],
    ),
    Case("bare_leading_ws", f" \n {PARIS_JSON}", [(f" \n {PARIS_JSON}", [PARIS])]),
    Case("bare_trailing_text", f"{PARIS_JSON}\nChecking now.", [(f"{PARIS_JSON}\n", [PARIS])]),
    Case("bare_list", f"[{PARIS_JSON}, {NEWS_JSON}]", [(f"[{PARIS_JSON}, {NEWS_JSON}]", [PARIS, NEWS])]),
    Case("bare_two_in_a_row", f"{PARIS_JSON}\n{NEWS_JSON}", [(f"{PARIS_JSON}\n", [PARIS]), (NEWS_JSON, [NEWS])]),
    Case("mistral", f"[TOOL_CALLS] [{PARIS_JSON}, {NEWS_JSON}]", [(f"[TOOL_CALLS] [{PARIS_JSON}, {NEWS_JSON}]", [PARIS, NEWS])]),
    Case("mistral_object", f"[TOOL_CALLS]{PARIS_JSON}", [(f"[TOOL_CALLS]{PARIS_JSON}", [PARIS])]),
    # fenced
    Case(
        "qwen_coder_fence",  # Qwen2.5-Coder-0.5B, greedy
        '```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```',
        [('```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```', [PARIS])],
    ),
    Case("plain_fence_trailing_text", f"```\n{PARIS_JSON}\n```\nDone.", [(f"```\n{PARIS_JSON}\n```\n", [PARIS])]),
    Case("fence_list", f"```json\n[{PARIS_JSON}, {NEWS_JSON}]\n```", [(f"```json\n[{PARIS_JSON}, {NEWS_JSON}]\n```", [PARIS, NEWS])]),
    Case(
        "two_fences",
        f"```json\n{PARIS_JSON}\n```\n```json\n{NEWS_JSON}\n```",
        [(f"```json\n{PARIS_JSON}\n```\n", [PARIS]), (f"```json\n{NEWS_JSON}\n```", [NEWS])],
    ),
    Case("fence_unclosed", f"```json\n{PARIS_JSON}\n", [(f"```json\n{PARIS_JSON}\n", [PARIS])]),
    # unclosed blocks
    Case(
        "qwen_unclosed",  # Qwen2.5-Coder-0.5B, greedy: no closing tag
        '<tool_call>\n{"name": "search_web", "arguments": {"query": "latest news"}}',
        [('<tool_call>\n{"name": "search_web", "arguments": {"query": "latest news"}}', [NEWS])],
    ),
    Case("unclosed_then_block", f"<tool_call>\n{PARIS_JSON}\n{H_NEWS}", [(f"<tool_call>\n{PARIS_JSON}\n", [PARIS]), (H_NEWS, [NEWS])]),
    text_only("unclosed_malformed", 'Sure. <tool_call>\n{"name": "search_web", "argu'),
    # text, not calls
    text_only("plain", "The weather in Paris is sunny."),
    text_only("empty", ""),
    text_only("only_ws", " \n\t"),
    text_only("tag_in_prose", "Models wrap calls in <tool_call> tags; <tool_call> is a word here."),
    text_only("tag_pair_in_prose", "Wrap calls in <tool_call></tool_call> tags."),
    text_only("toolbox", "<toolbox> holds tools, <tool_c and <tool"),
    text_only("malformed_block", '<tool_call>{"name": "get_weather", "arguments": {"city": }</tool_call> oops'),
    text_only("malformed_block_after_ws", "\n <tool_call>{not json}</tool_call>"),
    text_only("undeclared_block", '<tool_call>{"name": "delete_all", "arguments": {}}</tool_call>'),
    text_only("undeclared_bare", '{"name": "delete_all", "arguments": {}}'),
    text_only("list_with_undeclared", f'[{PARIS_JSON}, {{"name": "delete_all"}}]'),
    text_only("json_answer", '{"answer": 42}'),
    text_only("json_answer_with_name", '{"name": "Alice", "age": 3}'),
    text_only("json_array_answer", "[1, 2, 3]"),
    text_only("fenced_answer", '```json\n{"answer": 42}\n```'),
    text_only("fenced_code", "```python\nprint(1)\n```"),
    text_only("inline_code", "`x` is a variable"),
    text_only("bad_arguments", '{"name": "get_weather", "arguments": [1]}'),
    text_only("bad_arguments_string", '{"name": "get_weather", "arguments": "city=Paris"}'),
    text_only("name_not_string", '{"name": ["get_weather"], "arguments": {}}'),
    text_only("brace_prose", "{ this is not JSON"),
    text_only("lone_brace", "{"),
    text_only("unfinished_json", '{"name": "get_weather", "arguments": {"ci'),
    text_only("mistral_alone", "[TOOL_CALLS]"),
    text_only("bare_after_prose", f"Here it is: {PARIS_JSON}"),
    text_only("fence_after_prose", f"Call:\n```json\n{PARIS_JSON}\n```"),
    Case("bare_after_call_and_prose", f"{H_PARIS}Done. {NEWS_JSON}", [(H_PARIS, [PARIS])]),
    text_only("fence_with_extra", f"```json\n{PARIS_JSON}\nmore\n```"),
    Case("answer_then_block", f'{{"answer": 1}} {H_PARIS}', [(H_PARIS, [PARIS])]),
]


def flat(pieces: list[Piece]) -> list[str | ToolCall]:
    """Pieces as characters and calls, so that how text was split or merged does not matter."""
    return [x for p in pieces for x in (list(p.text) if isinstance(p, Text) else [p])]


def expected(case: Case) -> list[str | ToolCall]:
    """The reply with each call's source span replaced by its calls."""
    out: list[str | ToolCall] = []
    pos = 0
    for span, calls in case.spans:
        at = case.reply.index(span, pos)
        out += list(case.reply[pos:at]) + calls
        pos = at + len(span)
    return out + list(case.reply[pos:])


def stream(case: Case, chunks: list[str]) -> list[str | ToolCall]:
    """Feeds the chunks, checking after each that nothing released is later taken back; returns what came out."""
    want = expected(case)
    parser = ToolCallParser(NAMES)
    got: list[str | ToolCall] = []
    fed = ""
    for chunk in chunks:
        got += flat(parser.feed(chunk))
        fed += chunk
        assert got == want[: len(got)], f"released too early after {fed!r}"
        assert fed.endswith(parser.held)
    got += flat(parser.finish())
    assert parser.held == ""
    return got


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_parse_reply(case: Case):
    text, calls = parse_reply(case.reply, NAMES)
    want = expected(case)
    assert text == "".join(x for x in want if isinstance(x, str))
    assert calls == [x for x in want if isinstance(x, ToolCall)]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_stream_two_chunks(case: Case):
    for i in range(len(case.reply) + 1):
        assert stream(case, [case.reply[:i], case.reply[i:]]) == expected(case), f"split at {i}"


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_stream_char_by_char(case: Case):
    assert stream(case, list(case.reply)) == expected(case)


def test_two_calls_in_one_chunk():
    parser = ToolCallParser(NAMES)
    assert parser.feed("Checking.\n") == [Text("Checking.\n")]
    assert parser.feed(f"{H_PARIS}\n{H_NEWS}\n") == [PARIS, NEWS]
    assert parser.held == ""
    assert parser.feed("Done.") == [Text("Done.")]
    assert parser.finish() == []


def test_unicode_kept_unescaped():
    _, [c] = parse_reply('<tool_call>{"name": "search_web", "arguments": {"q": "\\u00e9t\\u00e9 中文 🌧️"}}</tool_call>', NAMES)
    assert c.arguments == '{"q": "été 中文 🌧️"}'
    assert json.loads(c.arguments) == {"q": "été 中文 🌧️"}


@pytest.mark.parametrize(
    ("chunks", "released", "held"),
    [
        (["Hello"], "Hello", ""),
        (["Hello <tool"], "Hello ", "<tool"),
        (["<tool"], "", "<tool"),
        (["Hi <tool", "box>"], "Hi <toolbox>", ""),
        (["<tool_call>\n{"], "", "<tool_call>\n{"),
        (["Hi <tool_call>{}"], "Hi ", "<tool_call>{}"),
        (["  "], "", "  "),
        (["{"], "", "{"),
        (['{"name'], "", '{"name'),
        (["{ x"], "{ x", ""),
        (["["], "", "["),
        (["[TOOL"], "", "[TOOL"),
        (["[1"], "[1", ""),
        (["`"], "", "`"),
        (["```js"], "", "```js"),
        (["```p"], "```p", ""),
        (["```json\n{"], "", "```json\n{"),
        ([f"{PARIS_JSON}\n"], "", ""),
        ([f"{PARIS_JSON}\n", "\n", " <to"], "", "<to"),
        (["Hi ", PARIS_JSON], f"Hi {PARIS_JSON}", ""),
    ],
)
def test_held(chunks: list[str], released: str, held: str):
    parser = ToolCallParser(NAMES)
    pieces = [p for chunk in chunks for p in parser.feed(chunk)]
    assert "".join(p.text for p in pieces if isinstance(p, Text)) == released
    assert parser.held == held


def test_no_tools_passes_text_through():
    parser = ToolCallParser([])
    assert parser.feed(H_PARIS) == [Text(H_PARIS)]
    assert parser.finish() == []
    assert parse_reply(PARIS_JSON, []) == (PARIS_JSON, [])


def cut(name: str, arguments: str) -> ToolCall:
    return ToolCall(name, arguments, complete=False)


@pytest.mark.parametrize(
    ("reply", "pieces"),
    [
        # max_tokens inside a Hermes block, a bare call, a fenced one, a list: a call cut short, never text
        ('<tool_call>\n{"name": "get_weather", "arguments": {"ci', [cut("get_weather", '{"ci')]),
        ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par', [Text("Let me check.\n"), cut("get_weather", '{"city": "Par')]),
        ('{"name": "get_weather", "arguments": {"city": "Paris", "un', [cut("get_weather", '{"city": "Paris", "un')]),
        ('```json\n{"name": "search_web", "arg', [cut("search_web", "")]),
        ('[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "search_web", "arguments": {"q', [PARIS, cut("search_web", '{"q')]),
        # the name not there yet (or not a declared tool's): nothing, neither text nor a call
        ('<tool_call>\n{"na', []),
        ('Hi <tool_call>\n{"name": "get_wea', [Text("Hi ")]),
        ('<tool_call>{"name": "delete_all", "arguments": {', []),
        ("Hi <tool_ca", [Text("Hi ")]),
        ("<tool_c", []),
        # whole before the cut: a whole call (inside the close tag, or an unclosed block that parses)
        (f'<tool_call>\n{PARIS_JSON}\n</tool_', [PARIS]),
        (f"<tool_call>\n{PARIS_JSON}", [PARIS]),
        (f"{H_PARIS}\nDone", [PARIS, Text("Done")]),
        # prose, cut anywhere, stays prose
        ("The weather is", [Text("The weather is")]),
        ('{"city": "Par', [Text('{"city": "Par')]),
        ('{"name": "delete_all", "arg', [Text('{"name": "delete_all", "arg')]),
        ('{"name": "get_wea', []),
    ],
)
def test_a_reply_cut_inside_a_call(reply: str, pieces: list[Piece]):
    assert parse_pieces(reply, NAMES, cut=True) == pieces
    for i in range(len(reply) + 1):  # streamed, split anywhere: the same pieces
        parser = ToolCallParser(NAMES)
        assert _merged(parser.feed(reply[:i]) + parser.feed(reply[i:]) + parser.finish(cut=True)) == pieces, f"split at {i}"


def test_without_the_cut_an_unfinished_call_is_text():
    reply = '<tool_call>\n{"name": "get_weather", "arguments": {"ci'
    assert parse_pieces(reply, NAMES) == [Text(reply)]  # the model ended it so: what it wrote, unchanged


@pytest.mark.parametrize(
    ("arguments", "members"),
    [
        ('{"city": "Paris"}', {"city": "Paris"}),
        ('{"city": "Paris", "days": 3, "un', {"city": "Paris", "days": 3}),
        ('{"a": {"b": 1, "c": [1, 2', {}),
        ('{"a": "x,y", "b": [1, 2], "c"', {"a": "x,y", "b": [1, 2]}),
        ('{"a": "say \\"hi\\", ok", "b', {"a": 'say "hi", ok'}),
        ("", {}),
        ("[1, 2]", {}),
    ],
)
def test_complete_members(arguments: str, members: dict):
    assert complete_members(arguments) == members


def _merged(pieces: list[Piece]) -> list[Piece]:
    out: list[Piece] = []
    for p in pieces:
        if isinstance(p, Text) and out and isinstance(out[-1], Text):
            out[-1] = Text(out[-1].text + p.text)
        elif not isinstance(p, Text) or p.text:
            out.append(p)
    return out
