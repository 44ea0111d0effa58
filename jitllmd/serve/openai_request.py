"""An OpenAI request's body, read: what a chat completion or a completion asks of the engine (the prompt's ids, the
sampling settings, the grammar, the tools), checked field by field, each error naming its field. The routes that use
it, and what they answer: openai.py."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from ..engine.catalog import ServedModel
from ..engine.grammar import GrammarSpec
from ..engine.kv import RoomError
from ..engine.request import Generation
from ..engine.sampler import MAX_LOGPROBS, SamplingParams
from ..engine.sessions import Session
from ..engine.tokenizer import Tokenizer
from .body import APIError, Fields
from .outbox import Outbox
from .prompt import (
    check_room,
    check_tool_schema,
    constraints,
    encode_in_room,
    remember,
    request_options,
    room_error,
    sampling_params,
    start,
    tool_grammar,
)
from .reasoning import EFFORTS, Reasoning, markers_of, plan_reasoning

__all__ = ["ROLES", "Limits", "OpenAIGeneration", "chat_messages", "chat_reasoning", "completion_prompts", "parse_common", "prompt_items", "tools_of"]


ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}  # OpenAI's -> chat templates'
_REASONING = ("reasoning_content", "reasoning")  # an assistant message's thought, as vLLM and llama-server send it back



@dataclass(frozen=True)
class OpenAIGeneration:
    """What both OpenAI routes ask of the engine, parsed from the body."""

    served: ServedModel
    model: str  # the name the client sent, echoed back
    params: SamplingParams
    max_tokens: int | None
    stop: list[str]
    stream: bool
    include_usage: bool
    session: Session | None = None  # a named session (jitllm_session)
    chat: list[dict[str, Any]] | None = None  # the whole conversation, for the session to remember
    tool_names: frozenset[str] | None = None  # the declared tools: replies are parsed for calls to them
    prompt_logprobs: int | None = None  # completions' echo with logprobs: the prompt scored too
    n: int = 1  # choices per prompt
    grammar: GrammarSpec | None = None  # what every reply must be: response_format's JSON, or a forced tool call
    grammar_param: str = "response_format"  # the field that asked for it, for its errors
    reasoning: Reasoning | None = None  # chat: the template's extra variables and, for a model that thinks, its thought
    options: dict[str, Any] = field(default_factory=dict)  # ignore_eos, jitllm.speculative / draft_max: Generation's keywords (request_options)

    @property
    def thinks(self) -> bool:
        """A chat with a model that thinks: replies split into reasoning and answer, usage counts reasoning tokens."""
        return self.reasoning is not None and self.reasoning.thinks

    @property
    def template_kwargs(self) -> dict[str, Any] | None:
        """The chat template's extra variables (chat_prompt_ids' `extra`)."""
        return dict(self.reasoning.template_kwargs) if self.reasoning is not None else None

    async def start_all(self, param: str, request_id: str, prompts: list[list[int]]) -> list[Outbox]:
        """The n choices of each prompt: the first runs the prompt, the others follow it (the prompt is fed once) and
        sample on their own, with seed + i when a seed is given, each under its own matcher of the grammar, if any.
        Every one is built before any is queued, and all are queued together: a refusal of one (a prompt with no room)
        ends those already built, before any ran."""
        matchers = await constraints(self.served, self.grammar, self.n * len(prompts), self.grammar_param)
        outboxes: list[Outbox] = []
        try:
            for k, prompt_ids in enumerate(prompts):
                first: Outbox | None = None
                for i in range(self.n):
                    params = self.params
                    if i and params.seed is not None:
                        params = replace(params, seed=(params.seed + i) % (1 << 64))
                    spec = Generation(
                        prompt_ids, params, max_tokens=self.max_tokens, stop=self.stop, session=self.session,
                        request_id=request_id + (f"-p{k}" if k else "") + (f"-{i}" if i else ""), prompt_logprobs=self.prompt_logprobs,
                        constraint=matchers[k * self.n + i],
                        thinking=self.reasoning.thinking(self.tokenizer, prompt_ids) if self.reasoning is not None else None,
                        **self.options,
                    )
                    where = f"{param}[{k}]" if len(prompts) > 1 else param
                    outboxes.append(start(self.served, spec, param=where, follows=first.request if first else None, hold=True))
                    first = first or outboxes[-1]
        except BaseException:
            for o in outboxes:
                o.end()  # never queued: the engine releases their slots
            raise
        self.served.engine.enqueue([o.request for o in outboxes])
        return outboxes

    @property
    def tokenizer(self) -> Tokenizer:
        return self.served.engine.loaded.tokenizer

    def done(self, reply: str | dict[str, Any]) -> None:
        if self.chat is not None:
            remember(self.session, self.chat, reply)


@dataclass(frozen=True)
class Limits:
    """What one request may fan out to (serve's -max-choices and -max-constrained): each choice is a row with its own
    session, each constrained one also a grammar matcher with its token masks (megabytes for a large vocabulary)."""

    choices: int = 64  # prompts x n
    constrained: int = 16  # choices under a grammar: response_format, or a forced tool call


def parse_common(
    f: Fields, served: ServedModel, model: str, max_tokens_keys: tuple[str, ...], session: Session | None,
    chat: list[dict[str, Any]] | None = None, tools: list[dict[str, Any]] | None = None, *, prompts: int = 1, limits: Limits = Limits(),
    reasoning: Reasoning | None = None,
) -> OpenAIGeneration:
    """The fields both routes read, checked before any prompt is templated or tokenized; `prompts`: how many the
    request holds, whose choices the limits count. A chat's reasoning fields (reasoning_effort, thinking_token_budget,
    chat_template_kwargs) are read here unless `reasoning` is given (another dialect's, read its own way)."""
    max_tokens = None
    echo = chat is None and f.boolean("echo")
    for key in max_tokens_keys:  # the first one given wins
        if f.has(key):
            max_tokens = f.integer(key, low=0 if echo else 1)  # echo with max_tokens 0: the prompt alone (scored)
            break
    n = f.integer("n", 1, low=1, high=128) or 1  # OpenAI's own bound; the server's is limits.choices
    if n > 1 and session is not None:
        raise f.error("n", "a named session holds one conversation: n must be 1 with jitllm_session")
    if chat is not None:  # chat: logprobs true, top_logprobs 0-20
        top = f.integer("top_logprobs", low=0, high=MAX_LOGPROBS)
        if top is not None and not f.boolean("logprobs"):
            raise f.error("top_logprobs", "needs logprobs: true")
        logprobs = (top or 0) if f.boolean("logprobs") else None
    else:  # completions: logprobs 0-5, the alternatives per token
        logprobs = f.integer("logprobs", low=0, high=5)
    if echo and logprobs is not None and session is not None:
        raise f.error("echo", "echo with logprobs scores the whole prompt: send it without jitllm_session")
    grammar, grammar_param = _response_grammar(f), "response_format"
    forced, name = _forced_tool(f)
    if tools and forced:  # the reply is a call: the tool grammar wins over response_format
        grammar, grammar_param = tool_grammar(served, tools, name, "tool_choice"), "tool_choice"
    if prompts * n > limits.choices:
        raise f.error("n" if n > 1 else "prompt", f"{prompts} prompt{'s' if prompts > 1 else ''} x n={n} make {prompts * n} choices; this "
                      f"server runs at most {limits.choices} for one request (serve -max-choices)")
    if grammar is not None and prompts * n > limits.constrained:
        raise f.error(grammar_param, f"{prompts * n} choices each under its own grammar; this server compiles at most {limits.constrained} "
                                     "for one request (serve -max-constrained)")
    top_k = f.integer("top_k", 40, low=-1)
    params = sampling_params(
        temperature=f.number("temperature", 1.0, low=0.0, high=2.0),
        top_p=f.number("top_p", 1.0, low=0.0, high=1.0) or 1e-9,  # top_p 0 keeps only the most likely token
        top_k=max(0, top_k or 0),  # -1 (vLLM) and 0 both disable it
        min_p=f.number("min_p", 0.0, low=0.0, high=1.0),
        seed=f.integer("seed"),
        presence_penalty=f.number("presence_penalty", 0.0, low=-2.0, high=2.0),
        frequency_penalty=f.number("frequency_penalty", 0.0, low=-2.0, high=2.0),
        repetition_penalty=f.number("repetition_penalty", 1.0, low=0.0),
        logit_bias=_logit_bias(f, served.engine.loaded.tokenizer.vocab_size),
        logprobs=logprobs,
    )
    options = f.object("stream_options")
    if options is not None and not f.boolean("stream"):  # as OpenAI answers it
        raise f.error("stream_options", "only allowed when stream is true")
    if reasoning is None and chat is not None:
        reasoning = chat_reasoning(f, served)
    return OpenAIGeneration(
        served=served,
        model=model,
        params=params,
        max_tokens=max_tokens,
        stop=f.strings("stop"),
        stream=f.boolean("stream"),
        include_usage=options.boolean("include_usage") if options else False,
        session=session,
        chat=chat,
        tool_names=frozenset(t["function"]["name"] for t in tools) if tools else None,
        prompt_logprobs=logprobs if echo else None,
        n=n,
        grammar=grammar,
        grammar_param=grammar_param,
        reasoning=reasoning,
        options=request_options(f),
    )


# Variables every chat template gets from the request itself (and the render call's own names): chat_template_kwargs
# may not set them.
_TEMPLATE_OWN = ("messages", "tools", "add_generation_prompt", "self")


def chat_reasoning(f: Fields, served: ServedModel) -> Reasoning:
    """A chat's thought: `reasoning_effort` (none, minimal, low, medium, high), vLLM's `thinking_token_budget` (tokens
    inside the thought before its close marker is forced; -1: unbounded) and `chat_template_kwargs` (more variables for
    the template, e.g. {"enable_thinking": false}), over the model's markers (reasoning.py)."""
    effort = f.string("reasoning_effort")
    if effort is not None and effort not in EFFORTS:
        raise f.error("reasoning_effort", f"{effort!r}: expected one of {', '.join(EFFORTS)}")
    budget = f.integer("thinking_token_budget", low=-1)
    kwargs = f.object("chat_template_kwargs")
    for key in _TEMPLATE_OWN:
        if kwargs is not None and key in kwargs.obj:
            raise kwargs.error(key, "set by the request itself, not by chat_template_kwargs")
    return plan_reasoning(markers_of(served), effort=effort, budget=budget, template_kwargs=kwargs.obj if kwargs is not None else None)


def _response_grammar(f: Fields) -> GrammarSpec | None:
    """response_format: text (free), json_object (any JSON object), json_schema (JSON valid against its schema)."""
    fmt = f.object("response_format")
    kind = fmt.string("type", required=True) if fmt is not None else "text"
    if fmt is None or kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec(schema={"type": "object"})
    if kind == "json_schema":
        spec = fmt.object("json_schema")
        if spec is None:
            raise fmt.error("json_schema", "this field is required")
        spec.string("name", required=True)
        schema = spec.object("schema")
        return GrammarSpec(schema=schema.obj if schema is not None else {"type": "object"})
    raise fmt.error("type", f"{kind!r}: expected text, json_object or json_schema")


def _forced_tool(f: Fields) -> tuple[bool, str | None]:
    """tool_choice as a constraint: (True, None) for "required" (some tool), (True, name) for a named function."""
    choice = f.raw("tool_choice")
    if choice == "required":
        return True, None
    if isinstance(choice, dict):
        fn = Fields(choice, "tool_choice.").object("function")
        return True, fn.string("name", required=True) if fn is not None else None
    return False, None


def _logit_bias(f: Fields, vocab: int) -> tuple[tuple[int, float], ...]:
    """logit_bias: {"token id": bias in [-100, 100]} -> ((id, bias), ...) sorted by id."""
    biases = f.object("logit_bias")
    if biases is None:
        return ()
    if len(biases.obj) > vocab:  # distinct ids: no more than the vocabulary has
        raise f.error("logit_bias", f"{len(biases.obj)} entries, but the vocabulary has {vocab} tokens")
    out = []
    for key in biases.obj:
        if not (key.isascii() and key.isdigit() and len(key) <= 10):  # "²" is a digit int() refuses; 5,000 digits, one it refuses too
            raise f.error("logit_bias", f"keys are token ids (strings of at most 10 digits 0-9), got {key[:40]!r}")
        out.append((int(key), biases.number(key, 0.0, low=-100.0, high=100.0)))
    return tuple(sorted(out))


def chat_messages(f: Fields) -> list[dict[str, Any]]:
    """The messages in the shape chat templates take: tool calls kept (arguments parsed by the template layer)."""
    raw = f.array("messages", required=True) or []
    if not raw:
        raise f.error("messages", "must hold at least one message")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(raw):
        m = Fields(item, f"messages[{i}].")
        role = m.string("role", required=True)
        if role not in ROLES and role != "tool":
            raise m.error("role", f"{role!r} is not a role: use system, developer, user, assistant or tool")
        if m.has("function_call"):
            raise m.error("function_call", "the legacy function_call is not supported: use tool_calls")
        if role not in ("assistant", "tool") and m.raw("content") is None:
            raise m.error("content", "this field is required")
        msg: dict[str, Any] = {"role": ROLES.get(role, role), "content": m.text("content", items="content parts")}
        if role == "assistant" and m.has("tool_calls"):
            msg["tool_calls"] = _message_tool_calls(m)
        for key in (_REASONING if role == "assistant" else ()):  # a past turn's thought, for templates that show it
            if m.has(key):
                msg["reasoning_content"] = m.string(key)
                break
        if role == "tool":
            msg["tool_call_id"] = m.string("tool_call_id", required=True)
        out.append(msg)
    return out


def _message_tool_calls(m: Fields) -> list[dict[str, Any]]:
    calls = []
    for j, item in enumerate(m.array("tool_calls") or []):
        c = Fields(item, m.name(f"tool_calls[{j}]."))
        if c.string("type", "function") != "function":
            raise c.error("type", "only function tool calls are supported")
        fn = c.object("function")
        if fn is None:
            raise c.error("function", "this field is required")
        call: dict[str, Any] = {"id": c.string("id")} if c.has("id") else {}
        call.update(type="function", function={"name": fn.string("name", required=True), "arguments": fn.string("arguments", "{}")})
        calls.append(call)
    return calls


def tools_of(f: Fields) -> list[dict[str, Any]] | None:
    """The tool definitions, exactly as sent; None when there are none or tool_choice is "none" (withheld).
    "auto" leaves the choice to the model; "required" and a named function make the reply a call (_forced_tool)."""
    choice = f.raw("tool_choice")
    if choice is not None and choice not in ("none", "auto", "required"):
        named = Fields(choice, "tool_choice.")
        if named.string("type", required=True) != "function" or named.object("function") is None:
            raise f.error("tool_choice", 'expected "none", "auto", "required" or {"type": "function", "function": {"name": ...}}')
    tools = f.array("tools")
    if not tools or choice == "none":
        return None
    for j, item in enumerate(tools):
        t = Fields(item, f"tools[{j}].")
        if t.string("type", required=True) != "function":
            raise t.error("type", "only function tools are supported")
        fn = t.object("function")
        if fn is None:
            raise t.error("function", "this field is required")
        fn.string("name", required=True)
        parameters = fn.object("parameters")
        if parameters is not None:
            check_tool_schema(parameters)
    return tools


MAX_PROMPTS = 2048  # prompts in one /v1/completions (OpenAI's bound); the server's is on choices (Limits)


def prompt_items(f: Fields) -> list[Any]:
    """prompt: a string, token ids, or an array of either (one choice per prompt): the prompts, unread."""
    prompt = f.raw("prompt")
    if prompt is None:
        raise f.error("prompt", "this field is required")
    many = isinstance(prompt, list) and bool(prompt) and all(isinstance(p, (str, list)) for p in prompt)
    items = prompt if many else [prompt]
    if len(items) > MAX_PROMPTS:
        raise f.error("prompt", f"{len(items)} prompts in one request: at most {MAX_PROMPTS}")
    return items


def completion_prompts(f: Fields, served: ServedModel, session: Session | None, items: list[Any]) -> list[tuple[list[int], str]]:
    """(ids, the prompt's text for echo) per prompt of `items` (prompt_items). Runs on a prompt thread (off_loop)."""
    many = items is f.raw("prompt")  # an array of prompts, not one prompt of token ids
    return [_one_prompt(f, served, session, p, f"prompt[{k}]" if many else "prompt") for k, p in enumerate(items)]


def _one_prompt(f: Fields, served: ServedModel, session: Session | None, prompt: Any, param: str) -> tuple[list[int], str]:
    if isinstance(prompt, str):
        check_room(served, session, prompt, param)
        if not prompt:
            raise APIError(f"{param}: the prompt is empty", param="prompt")
        try:
            return encode_in_room(served, session, prompt), prompt
        except RoomError as exc:
            raise room_error(exc, param) from None
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if not prompt:
            raise APIError(f"{param}: the prompt is empty", param="prompt")
        vocab = served.engine.loaded.tokenizer.vocab_size
        if any(not 0 <= t < vocab for t in prompt):
            raise APIError(f"{param}: token ids must be in [0, {vocab})", param="prompt")
        return list(prompt), served.engine.loaded.tokenizer.decode(prompt, skip_special_tokens=False)
    raise APIError(f"{param}: expected a string, an array of token ids, or an array of either", param="prompt")
