"""Reasoning models: markers found from the template and the vocabulary, the splitter (every cut of a marker), the
effort and budget mapping, and a real server of the scripted tiny thinking Qwen3 (conftest's write_tiny_thinker: greedy,
it writes "<think>abcdef</think>\\n\\nOK!") through the openai and anthropic SDKs: reasoning_content and thinking blocks,
streamed and not, the budget that forces the close marker per row, grammars after the thought, reasoning tokens, bad
fields; a model that does not think answers as before."""

from __future__ import annotations

import asyncio
import json
import re

import anthropic
import httpx
import openai
import pytest

from jitllmd.engine.chat import ChatTemplate
from jitllmd.engine.tokenizer import Tokenizer
from jitllmd.serve.reasoning import (
    EFFORT_BUDGETS,
    Markers,
    ReasoningSplitter,
    detect_markers,
    plan_reasoning,
    prompt_opens,
    split_reasoning,
)
from tests.conftest import CHAT_TEMPLATE, THINKER_TEMPLATE, fixed_tokenizer_json, thinker_tokenizer_json

USER = [{"role": "user", "content": "Hi"}]
GREEDY = {"temperature": 0}
MARKERS = Markers("<think>", "</think>", 90, 91, "\n\n", (84,), "enable_thinking")
PERSON = {"type": "object", "properties": {"x": {"const": 1}}, "required": ["x"], "additionalProperties": False}
NO_ARGS = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}, "additionalProperties": False}}}


def thinker_tokenizer() -> Tokenizer:
    return Tokenizer(thinker_tokenizer_json(), bos_token_id=None, eos_token_ids=[86], add_bos_token=False)


# -- markers, splitting, planning -----------------------------------------------------------------------------------------


def test_markers_of_a_thinking_template():
    tok = thinker_tokenizer()
    m = detect_markers(ChatTemplate(THINKER_TEMPLATE), tok)
    assert m == Markers("<think>", "</think>", tok.token_id("<think>"), tok.token_id("</think>"), "\n\n", (tok.token_id("\u010a\u010a"),), "enable_thinking")


def test_no_markers_without_a_thinking_template_or_vocabulary():
    assert detect_markers(ChatTemplate(THINKER_TEMPLATE.replace("</think>", "</thought>")), thinker_tokenizer()) is None  # template does not close one
    plain = Tokenizer(fixed_tokenizer_json(), bos_token_id=1, eos_token_ids=[2], add_bos_token=False)
    assert detect_markers(ChatTemplate(CHAT_TEMPLATE), plain) is None  # SmolLM2-like
    assert detect_markers(ChatTemplate(THINKER_TEMPLATE), plain) is None  # no <think> token
    assert detect_markers(ChatTemplate(None), thinker_tokenizer()) is None
    special = json.loads(thinker_tokenizer_json())  # markers the detokenizer drops cannot be split out of the text
    for t in special["added_tokens"]:
        t["special"] = True
    tok = Tokenizer(json.dumps(special), bos_token_id=None, eos_token_ids=[86], add_bos_token=False)
    assert detect_markers(ChatTemplate(THINKER_TEMPLATE), tok) is None


R1_TEMPLATE = (  # DeepSeek-R1's distills, in short: no switch, past thoughts dropped, the generation prompt opens one
    "{%- for m in messages %}{%- set content = (m.content or '').split('</think>')[-1] %}"
    "{{- '<|im_start|>' + m.role + '\n' + content + '<|im_end|>\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n<think>\n' }}{%- endif %}"
)


def test_markers_of_a_template_that_opens_the_thought():
    tok = thinker_tokenizer()
    m = detect_markers(ChatTemplate(R1_TEMPLATE), tok)
    assert m is not None and (m.open, m.close, m.after, m.switch) == ("<think>", "</think>", "", None)
    assert prompt_opens(m, tok, tok.encode(ChatTemplate(R1_TEMPLATE).render(USER), add_special_tokens=False))
    off = plan_reasoning(m, effort="none")  # no switch to turn: a thought ends at its first token
    assert dict(off.template_kwargs) == {"reasoning_effort": "none"} and off.budget == 0


def _fed(pieces: list[str], inside: bool = False) -> tuple[str, str, bool]:
    s = ReasoningSplitter(MARKERS, inside=inside)
    reasoning, answer = [], []
    for p in pieces:
        got = s.feed(p)
        reasoning.append(got.reasoning)
        answer.append(got.answer)
        assert not (any(answer[:-1]) and got.reasoning), "a thought only ever comes first"
    got = s.finish()
    return "".join(reasoning) + got.reasoning, "".join(answer) + got.answer, s.thought


CASES = [
    # (reply, inside, thought, answer): the markers, the newlines after the close, a reply without a thought
    ("<think>\nplan it</think>\n\nThe answer</think> stays", False, "\nplan it", "The answer</think> stays"),
    ("thought</think>\n\nanswer <think>x", True, "thought", "answer <think>x"),
    ("Hello <think>no</think>", False, None, "Hello <think>no</think>"),
    ("\n<think>late</think>", False, None, "\n<think>late</think>"),
    ("<think>cut at max_tokens</thi", False, "cut at max_tokens</thi", ""),
    ("<think>x</think>\n\n", False, "x", ""),
    ("<thi", False, None, "<thi"),
    ("", True, "", ""),
]


@pytest.mark.parametrize(("reply", "inside", "thought", "answer"), CASES)
def test_splitter_every_cut(reply, inside, thought, answer):
    """Whole, one character at a time, and cut in two and in three at every position: the same split."""
    assert split_reasoning(reply, MARKERS, inside=inside) == (thought, answer)
    expected = (thought or "", answer, thought is not None)
    assert _fed(list(reply), inside) == expected
    for i in range(len(reply) + 1):
        assert _fed([reply[:i], reply[i:]], inside) == expected
        for j in range(i, len(reply) + 1):
            assert _fed([reply[:i], reply[i:j], reply[j:]], inside) == expected


def test_splitter_holds_a_cut_marker_back():
    s = ReasoningSplitter(MARKERS)
    assert s.feed("<thi").reasoning == "" and not s.thought
    assert s.feed("nk>ab</thi").reasoning == "ab" and s.thought and not s.closed
    got = s.feed("nk>\n")
    assert (got.reasoning, got.answer, s.closed) == ("", "", True)
    assert s.feed("\nOK").answer == "OK"


def test_prompt_opens():
    tok = thinker_tokenizer()
    chat = ChatTemplate(THINKER_TEMPLATE)
    ids = lambda text: tok.encode(text, add_special_tokens=False)
    assert prompt_opens(MARKERS, tok, ids(chat.render(USER, open_thinking=True)))
    assert prompt_opens(MARKERS, tok, ids(chat.render(USER) + "<think>\n"))  # DeepSeek-R1's generation prompt
    assert prompt_opens(MARKERS, tok, ids(chat.render(USER) + "<think>\nhalf a thought"))  # a prefill inside one
    assert not prompt_opens(MARKERS, tok, ids(chat.render(USER)))
    assert not prompt_opens(MARKERS, tok, ids(chat.render(USER, enable_thinking=False)))
    assert not prompt_opens(MARKERS, tok, ids(chat.render([{"role": "user", "content": "what is <think>?"}])))  # a turn came after it


def test_plan_reasoning():
    assert plan_reasoning(MARKERS) == plan_reasoning(MARKERS, template_kwargs={}) and plan_reasoning(MARKERS).budget is None
    assert plan_reasoning(MARKERS).template_kwargs == {}  # nothing asked: the template's own default, unbounded
    none = plan_reasoning(MARKERS, effort="none")
    assert dict(none.template_kwargs) == {"reasoning_effort": "none", "enable_thinking": False} and none.budget == 0
    for effort, budget in EFFORT_BUDGETS.items():
        plan = plan_reasoning(MARKERS, effort=effort)
        assert plan.budget == budget and plan.template_kwargs["enable_thinking"] is (budget != 0)
    assert plan_reasoning(MARKERS, effort="low", budget=7).budget == 7  # the explicit budget wins
    assert plan_reasoning(MARKERS, effort="low", budget=-1).budget is None
    assert plan_reasoning(MARKERS, budget=0).template_kwargs == {"enable_thinking": False}
    assert plan_reasoning(MARKERS, enabled=True, budget=5).template_kwargs == {"enable_thinking": True}
    off = plan_reasoning(MARKERS, effort="high", template_kwargs={"enable_thinking": False, "x": 1})
    assert off.budget == 0 and off.template_kwargs == {"reasoning_effort": "high", "enable_thinking": False, "x": 1}
    plain = plan_reasoning(None, effort="low", template_kwargs={"x": 1})  # no markers: the variables alone
    assert not plain.thinks and plain.template_kwargs == {"reasoning_effort": "low", "x": 1}
    with pytest.raises(ValueError, match="effort"):
        plan_reasoning(MARKERS, effort="maximum")


# -- the chat completions surface ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def thinker(serve, tiny_thinker_jlm):
    return serve("-load", str(tiny_thinker_jlm), "-id", "thinker", "-devices", "cpu", "-sessions", "4", "-max-batch", "4", "-max-seq", "512")


@pytest.fixture(scope="module")
def oai(thinker):
    with openai.OpenAI(base_url=thinker.url + "/v1", api_key="unused", max_retries=0) as c:
        yield c


def _chat(oai, **kw):
    return oai.chat.completions.create(model="thinker", messages=kw.pop("messages", USER), temperature=0, **kw)


def _streamed(oai, **kw) -> tuple[str, str, list[str], object]:
    """(reasoning, content, the order of the deltas' kinds, the usage chunk's usage) of a streamed chat."""
    reasoning, content, kinds, used = [], [], [], None
    for chunk in _chat(oai, stream=True, stream_options={"include_usage": True}, **kw):
        if chunk.usage is not None:
            used = chunk.usage
        for c in chunk.choices:
            extra = c.delta.model_extra or {}
            if extra.get("reasoning_content"):
                reasoning.append(extra["reasoning_content"])
                kinds.append("reasoning")
            if c.delta.content:
                content.append(c.delta.content)
                kinds.append("content")
    return "".join(reasoning), "".join(content), kinds, used


def test_chat_splits_the_thought(oai):
    r = _chat(oai)
    m = r.choices[0].message
    assert (m.model_extra["reasoning_content"], m.content, r.choices[0].finish_reason) == ("abcdef", "OK!", "stop")
    assert r.usage.completion_tokens == 12  # <think> a b c d e f </think> \n\n O K !
    assert r.usage.completion_tokens_details.reasoning_tokens == 8  # up to the close marker, markers included
    reasoning, content, kinds, used = _streamed(oai)
    assert (reasoning, content) == ("abcdef", "OK!")
    assert kinds == sorted(kinds, key=lambda k: k == "content")  # every reasoning delta before the first content delta
    assert used.completion_tokens_details.reasoning_tokens == 8 and used.completion_tokens == 12


def test_reasoning_effort_none_turns_thinking_off(oai):
    on, off = _chat(oai), _chat(oai, reasoning_effort="none")
    assert (off.choices[0].message.model_extra["reasoning_content"], off.choices[0].message.content) == (None, "OK!")
    assert off.usage.completion_tokens_details.reasoning_tokens == 0 and off.usage.completion_tokens == 3
    assert off.usage.prompt_tokens == on.usage.prompt_tokens + 4  # the template's empty thought: <think> \n\n </think> \n\n
    same = _chat(oai, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert same.choices[0].message.content == "OK!" and same.usage.prompt_tokens == off.usage.prompt_tokens
    low = _chat(oai, reasoning_effort="low")  # 512 tokens of thought: this one needs 6
    assert low.choices[0].message.model_extra["reasoning_content"] == "abcdef"


@pytest.mark.parametrize("stream", [False, True])
def test_budget_forces_the_close_marker(oai, stream):
    kw = {"extra_body": {"thinking_token_budget": 3}}
    if stream:
        reasoning, content, _, used = _streamed(oai, **kw)
    else:
        r = _chat(oai, **kw)
        reasoning, content, used = r.choices[0].message.model_extra["reasoning_content"], r.choices[0].message.content, r.usage
    assert (reasoning, content) == ("abc", "OK!")  # then </think> and the template's "\n\n", forced: the answer goes on
    assert used.completion_tokens_details.reasoning_tokens == 5 and used.completion_tokens == 9
    zero = _chat(oai, extra_body={"thinking_token_budget": 0})  # thinking off
    assert zero.choices[0].message.content == "OK!" and zero.choices[0].message.model_extra["reasoning_content"] is None


def test_budget_is_per_row(thinker):
    """Rows of one batched step: each its own budget; the others think on."""
    async def main() -> list[str | None]:
        async with openai.AsyncOpenAI(base_url=thinker.url + "/v1", api_key="unused", max_retries=0) as c:
            rs = await asyncio.gather(*(c.chat.completions.create(model="thinker", messages=USER, temperature=0, extra_body={"thinking_token_budget": b})
                                        for b in (1, -1, 4, 2)))
        return [r.choices[0].message.model_extra["reasoning_content"] for r in rs]

    assert asyncio.run(main()) == ["a", "abcdef", "abcd", "ab"]


def test_unclosed_thought_at_max_tokens(oai):
    r = _chat(oai, max_tokens=4)
    assert (r.choices[0].message.model_extra["reasoning_content"], r.choices[0].message.content, r.choices[0].finish_reason) == ("abc", "", "length")
    assert r.usage.completion_tokens_details.reasoning_tokens == 4
    reasoning, content, _, _ = _streamed(oai, max_tokens=4)
    assert (reasoning, content) == ("abc", "")


def test_prompt_that_opens_the_thought(oai):
    kw = {"extra_body": {"chat_template_kwargs": {"open_thinking": True}}}
    r = _chat(oai, **kw)
    assert (r.choices[0].message.model_extra["reasoning_content"], r.choices[0].message.content) == ("abcdef", "OK!")
    assert r.usage.completion_tokens_details.reasoning_tokens == 7 and r.usage.completion_tokens == 11
    assert _streamed(oai, **kw)[:2] == ("abcdef", "OK!")
    budget = _chat(oai, extra_body={"chat_template_kwargs": {"open_thinking": True}, "thinking_token_budget": 2})
    assert (budget.choices[0].message.model_extra["reasoning_content"], budget.choices[0].message.content) == ("ab", "OK!")


def test_past_reasoning_reaches_the_template(oai):
    turns = [*USER, {"role": "assistant", "content": "OK!"}, {"role": "user", "content": "Again"}]
    plain = _chat(oai, messages=turns, max_tokens=1)
    for key in ("reasoning_content", "reasoning"):
        turns[1] = {"role": "assistant", "content": "OK!", key: "abc"}
        told = _chat(oai, messages=turns, max_tokens=1)
        assert told.usage.prompt_tokens == plain.usage.prompt_tokens + 8  # <think> \n a b c \n </think> \n\n


@pytest.mark.parametrize("stream", [False, True])
def test_grammar_follows_the_thought(oai, stream):
    """response_format constrains the answer: the thought before it is free, its budget closes it without the template's
    whitespace (which the grammar would refuse); with thinking off the reply is the grammar's from its first token."""
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": PERSON}}
    think = {"90": 5}  # <think> over the grammar's tokens: thinking off, it may not open a thought all the same
    for extra, reasoning in (({}, "abcdef"), ({"thinking_token_budget": 2}, "ab"), ({"reasoning_effort": "none", "logit_bias": think}, None)):
        if stream:
            got, content, _, used = _streamed(oai, response_format=fmt, extra_body=extra)
            got = got or None
        else:
            r = _chat(oai, response_format=fmt, extra_body=extra)
            got, content, used = r.choices[0].message.model_extra["reasoning_content"], r.choices[0].message.content, r.usage
        assert (got, json.loads(content)) == (reasoning, {"x": 1}), extra
        assert used.completion_tokens_details.reasoning_tokens == (len(reasoning) + 2 if reasoning else 0)


@pytest.mark.parametrize("stream", [False, True])
def test_tool_call_after_the_thought(oai, stream):
    kw = {"tools": [NO_ARGS], "tool_choice": "required"}
    if stream:
        reasoning, calls = [], []
        for chunk in _chat(oai, stream=True, **kw):
            for c in chunk.choices:
                reasoning.append((c.delta.model_extra or {}).get("reasoning_content") or "")
                calls += c.delta.tool_calls or []
                finish = c.finish_reason or None
        assert "".join(reasoning) == "abcdef" and finish == "tool_calls"
        assert [(c.function.name, c.function.arguments) for c in calls] == [("f", "{}")]
    else:
        r = _chat(oai, **kw)
        m = r.choices[0].message
        assert m.model_extra["reasoning_content"] == "abcdef" and r.choices[0].finish_reason == "tool_calls"
        assert [(c.function.name, c.function.arguments) for c in m.tool_calls] == [("f", "{}")]


def test_choices_each_think(oai):
    r = _chat(oai, n=2, extra_body={"thinking_token_budget": 1})
    assert [c.message.model_extra["reasoning_content"] for c in r.choices] == ["a", "a"]
    assert r.usage.completion_tokens_details.reasoning_tokens == 6


BAD_CHAT = [
    ({"reasoning_effort": "maximum"}, "reasoning_effort"),
    ({"reasoning_effort": 3}, "reasoning_effort"),
    ({"thinking_token_budget": -2}, "thinking_token_budget"),
    ({"thinking_token_budget": "many"}, "thinking_token_budget"),
    ({"thinking_token_budget": 1.5}, "thinking_token_budget"),
    ({"chat_template_kwargs": "enable_thinking"}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs.messages"),
    ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs.add_generation_prompt"),
    ({"messages": [*USER, {"role": "assistant", "content": "x", "reasoning_content": 5}]}, "messages[1].reasoning_content"),
]


@pytest.mark.parametrize(("fields", "param"), BAD_CHAT)
def test_bad_chat_fields(thinker, fields, param):
    r = httpx.post(thinker.url + "/v1/chat/completions", json={"model": "thinker", "messages": USER, **fields}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and param in r.json()["error"]["message"]


# -- the Anthropic surface -------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def claude(thinker):
    with anthropic.Anthropic(base_url=thinker.url, api_key="unused", max_retries=0) as c:
        yield c


def _blocks(msg) -> list[dict]:
    return [b.model_dump(exclude_none=True) for b in msg.content]


def test_messages_thinking_blocks(claude):
    msg = claude.messages.create(model="thinker", max_tokens=40, messages=USER, extra_body=GREEDY)
    assert _blocks(msg) == [{"type": "thinking", "thinking": "abcdef", "signature": ""}, {"type": "text", "text": "OK!"}]
    assert msg.stop_reason == "end_turn" and msg.usage.output_tokens == 12
    with claude.messages.stream(model="thinker", max_tokens=40, messages=USER, extra_body=GREEDY) as s:
        kinds = [(ev.type, getattr(ev, "delta", None) and ev.delta.type) for ev in s if ev.type.startswith("content_block")]
        final = s.get_final_message()
    assert _blocks(final) == _blocks(msg)
    assert kinds[0] == ("content_block_start", None) and kinds[1:3] == [("content_block_delta", "thinking_delta")] * 2
    thinking_end = kinds.index(("content_block_delta", "signature_delta"))
    assert kinds[thinking_end + 1] == ("content_block_stop", None) and kinds[thinking_end + 2] == ("content_block_start", None)
    assert all(d != "thinking_delta" for _, d in kinds[thinking_end:])


def test_messages_event_sequence(thinker):
    body = {"model": "thinker", "max_tokens": 40, "temperature": 0, "messages": USER, "stream": True, "thinking": {"type": "enabled", "budget_tokens": 2}}
    with httpx.stream("POST", thinker.url + "/v1/messages", json=body, timeout=60) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    shapes = [(e["type"], (e.get("delta") or e.get("content_block") or {}).get("type")) for e in events]
    thinking = [e["delta"]["thinking"] for e in events if shapes[events.index(e)][1] == "thinking_delta"]
    text = [e["delta"]["text"] for e in events if e["type"] == "content_block_delta" and e["delta"]["type"] == "text_delta"]
    assert shapes == [
        ("message_start", None), ("ping", None),
        ("content_block_start", "thinking"), *[("content_block_delta", "thinking_delta")] * len(thinking),
        ("content_block_delta", "signature_delta"), ("content_block_stop", None),
        ("content_block_start", "text"), *[("content_block_delta", "text_delta")] * len(text), ("content_block_stop", None),
        ("message_delta", None), ("message_stop", None),
    ]
    assert "".join(thinking) == "ab" and "".join(text) == "OK!"
    assert [e["index"] for e in events if e["type"] == "content_block_start"] == [0, 1]


def test_messages_thinking_config(claude):
    def content(**kw) -> list[dict]:
        return _blocks(claude.messages.create(model="thinker", max_tokens=40, messages=USER, extra_body=GREEDY, **kw))

    assert content(thinking={"type": "disabled"}) == [{"type": "text", "text": "OK!"}]
    assert content(thinking={"type": "enabled", "budget_tokens": 3})[0]["thinking"] == "abc"
    assert content(thinking={"type": "adaptive"})[0]["thinking"] == "abcdef"
    assert content(thinking={"type": "enabled", "budget_tokens": 1024, "display": "omitted"})[0] == {"type": "thinking", "thinking": "", "signature": ""}
    cut = claude.messages.create(model="thinker", max_tokens=4, messages=USER, extra_body=GREEDY)
    assert _blocks(cut) == [{"type": "thinking", "thinking": "abc", "signature": ""}] and cut.stop_reason == "max_tokens"
    with claude.messages.stream(model="thinker", max_tokens=4, messages=USER, extra_body=GREEDY) as s:
        assert _blocks(s.get_final_message()) == _blocks(cut)


def test_messages_tool_use_after_thinking(claude):
    tool = {"name": "f", "input_schema": NO_ARGS["function"]["parameters"]}
    msg = claude.messages.create(model="thinker", max_tokens=60, messages=USER, tools=[tool], tool_choice={"type": "any"}, extra_body=GREEDY)
    blocks = _blocks(msg)
    assert blocks[0] == {"type": "thinking", "thinking": "abcdef", "signature": ""} and msg.stop_reason == "tool_use"
    assert [(b["type"], b["name"], b["input"]) for b in blocks[1:]] == [("tool_use", "f", {})]


def test_thinking_blocks_sent_back_reach_the_template(claude):
    def count(turn: list[dict]) -> int:
        messages = [*USER, {"role": "assistant", "content": turn}, {"role": "user", "content": "Again"}]
        return claude.messages.count_tokens(model="thinker", messages=messages).input_tokens

    plain = count([{"type": "text", "text": "OK!"}])
    assert count([{"type": "thinking", "thinking": "abc", "signature": ""}, {"type": "text", "text": "OK!"}]) == plain + 8
    assert count([{"type": "redacted_thinking", "data": "opaque"}, {"type": "text", "text": "OK!"}]) == plain
    disabled = claude.messages.count_tokens(model="thinker", messages=USER, thinking={"type": "disabled"}).input_tokens
    assert disabled == claude.messages.count_tokens(model="thinker", messages=USER).input_tokens + 4


BAD_MESSAGES = [
    ({"thinking": "on"}, "thinking"),
    ({"thinking": {"type": "on"}}, "thinking.type"),
    ({"thinking": {"type": "enabled"}}, "thinking.budget_tokens"),
    ({"thinking": {"type": "enabled", "budget_tokens": -1}}, "thinking.budget_tokens"),
    ({"thinking": {"type": "enabled", "budget_tokens": "lots"}}, "thinking.budget_tokens"),
    ({"thinking": {"type": "adaptive", "display": "full"}}, "thinking.display"),
    ({"output_config": {"effort": "huge"}}, "output_config.effort"),
    ({"messages": [{"role": "user", "content": [{"type": "thinking", "thinking": "x", "signature": ""}]}]}, "messages[0].content[0].type"),
    ({"messages": [*USER, {"role": "assistant", "content": [{"type": "thinking", "thinking": 5}]}, *USER]}, "messages[1].content[0].thinking"),
]


@pytest.mark.parametrize(("fields", "param"), BAD_MESSAGES)
def test_bad_messages_fields(thinker, fields, param):
    r = httpx.post(thinker.url + "/v1/messages", json={"model": "thinker", "max_tokens": 8, "messages": USER, **fields}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["type"] == "error" and re.match(re.escape(param) + "[: ]", r.json()["error"]["message"])


# -- a model that does not think -------------------------------------------------------------------------------------------


def test_a_model_without_markers_is_unchanged(serve, tiny_serve_jlm):
    """The tiny llama's template and vocabulary have no thought: no reasoning fields in what it answers; the new fields
    are taken (a client may send them to every model) and change nothing."""
    server = serve("-load", str(tiny_serve_jlm), "-id", "tiny", "-devices", "cpu", "-sessions", "8", "-max-batch", "8", "-max-seq", "512")
    body = {"model": "tiny", "messages": USER, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    plain = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60).json()
    asked = httpx.post(server.url + "/v1/chat/completions", json={**body, "reasoning_effort": "low", "thinking_token_budget": 2}, timeout=60).json()
    for r in (plain, asked):
        assert set(r["choices"][0]["message"]) == {"role", "content", "refusal"} and "completion_tokens_details" not in r["usage"]
    assert asked["choices"][0]["message"] == plain["choices"][0]["message"]
    assert asked["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"] and asked["usage"]["completion_tokens"] == 8
    stream = httpx.post(server.url + "/v1/chat/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}}, timeout=60).text
    assert "reasoning" not in stream
    msg = httpx.post(server.url + "/v1/messages", json={**body, "thinking": {"type": "enabled", "budget_tokens": 2}}, timeout=60).json()
    assert [b["type"] for b in msg["content"]] == ["text"]
