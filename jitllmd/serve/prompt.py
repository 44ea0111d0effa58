"""What every dialect does the same way: find the model, turn messages or text into prompt ids, start the engine request."""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from ..engine.catalog import Catalog, ServedModel
from ..engine.chat import ChatTemplateError
from ..engine.grammar import COMPACT_JSON, Constraint, GrammarError, GrammarSpec
from ..engine.kv import RoomError
from ..engine.loader import LoadedModel
from ..engine.request import Generation, Request
from ..engine.sampler import SamplingParams
from ..engine.sessions import Session
from .body import APIError, Fields
from .outbox import Outbox

__all__ = ["chat_prompt_ids", "render_chat", "encode_at_most", "check_room", "check_tool_schema", "constraints", "tool_grammar", "conversation", "find_model", "find_target", "off_loop", "remember", "sampling_params", "request_options", "start", "encode_in_room", "room_error", "BIG", "chars"]

T = TypeVar("T")

# Templating, tokenizing and grammar compiling run here, off the event loop (a 10 MiB prompt takes seconds), this many
# at once: the rest wait their turn, so a few huge requests hold a bounded amount of memory and /healthz answers
# meanwhile. Work on more than BIG characters has threads of its own, so a short request never waits behind it.
_PREPARERS = 2
BIG = 1 << 16
_pool = ThreadPoolExecutor(max_workers=_PREPARERS, thread_name_prefix="jitllmd-prompt")
_big_pool = ThreadPoolExecutor(max_workers=_PREPARERS, thread_name_prefix="jitllmd-prompt-big")
_NORMALIZED = 2  # a normalizer may shorten text (NFKC, collapsed spaces): refuse only at twice the bound


async def off_loop(work: Callable[..., T], *args: Any, size: int = 0, **kw: Any) -> T:
    """`work(*args, **kw)` on a prompt thread (`size`: the characters it works on); its exceptions raise here."""
    pool = _big_pool if size > BIG else _pool
    return await asyncio.get_running_loop().run_in_executor(pool, functools.partial(work, *args, **kw))


def chars(value: Any) -> int:
    """Characters in the strings of a JSON value."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(chars(v) for v in value.values())
    if isinstance(value, list):
        return sum(chars(v) for v in value)
    return 0


def _room(served: ServedModel, session: Session | None) -> int:
    return session.max_seq if session is not None else served.engine.loaded.max_seq


def check_room(served: ServedModel, session: Session | None, value: Any, param: str) -> None:
    """Refuse, before tokenizing any of it, a prompt whose characters alone make more tokens than the session holds."""
    loaded, room = served.engine.loaded, _room(served, session)
    least = chars(value) // (loaded.tokenizer.most_chars_per_token * _NORMALIZED)
    if least >= room:
        raise APIError(f"{param}: {chars(value)} characters make at least {least} tokens, but the session has room for {room}",
                       param=param, code="context_length_exceeded")


def encode_in_room(served: ServedModel, session: Session | None, text: str, *, add_special_tokens: bool = True) -> list[int]:
    """A prompt's ids (on a prompt thread: see off_loop). One that surely makes more tokens than the session holds is
    refused (RoomError) once a piece of it shows that, not after tokenizing all of it."""
    tokenizer, room = served.engine.loaded.tokenizer, _room(served, session)
    least = tokenizer.count_past(text, room - 1)
    if least is not None:
        raise RoomError(f"the prompt makes more than {least} tokens, but the session has room for {room}")
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


def encode_at_most(served: ServedModel, text: str, most: int, *, add_special_tokens: bool = True) -> list[int]:
    """text's ids (on a prompt thread), or RoomError naming how many it makes ("at least N" once a piece of a far longer
    text shows more than `most`, not after tokenizing all of it; else the count) where that is more than `most`."""
    tokenizer = served.engine.loaded.tokenizer
    least = tokenizer.count_past(text, most)
    if least is not None:
        raise RoomError(f"at least {least}")
    ids = tokenizer.encode(text, add_special_tokens=add_special_tokens)
    if len(ids) > most:
        raise RoomError(str(len(ids)))
    return ids


def room_error(exc: RoomError, param: str) -> APIError:
    return APIError(f"{param}: {exc}", param=param, code="context_length_exceeded")


def find_target(catalog: Catalog, name: str | None, session_id: str | None) -> tuple[ServedModel, Session | None]:
    """The model and named session a request runs in: `jitllm_session` takes precedence over `model`."""
    if session_id is None:
        return find_model(catalog, name), None
    try:
        return catalog.find_session(session_id)
    except KeyError:
        raise APIError(f"jitllm_session: no session {session_id!r} (create one with `jitllmd sessions -new`)", param="jitllm_session", kind="not_found") from None


def conversation(session: Session | None, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The whole chat a request runs: on a named session its messages follow the session's conversation, unless
    they begin with it (a client that resends the history), in which case they are the whole conversation."""
    if session is None:
        return messages
    so_far = session.messages
    if messages[: len(so_far)] == so_far:
        return messages
    return so_far + messages


def remember(session: Session | None, chat: list[dict[str, Any]], reply: str | dict[str, Any]) -> None:
    """After a reply on a named session, its conversation is the chat plus the reply (text, or an assistant
    message with tool calls)."""
    if session is not None:
        session.messages = [*chat, reply if isinstance(reply, dict) else {"role": "assistant", "content": reply}]


def find_model(catalog: Catalog, name: str | None) -> ServedModel:
    """The model a request names; with no name, the only loaded model."""
    if name is None:
        loaded = catalog.loaded()
        if len(loaded) == 1:
            return loaded[0]
        raise APIError("model: this field is required" + (" (several models are loaded)" if loaded else ""), param="model")
    try:
        return catalog.get(name)
    except KeyError as exc:
        raise APIError(str(exc.args[0]), param="model", kind="not_found", code="model_not_found") from None


async def chat_prompt_ids(
    served: ServedModel, messages: list[dict[str, Any]], session: Session | None, *, prefill: str | None = None,
    tools: list[dict[str, Any]] | None = None, extra: dict[str, Any] | None = None,
) -> list[int]:
    """Messages (and tool definitions, OpenAI shape) through the model's own chat template, off the event loop;
    `prefill` is the start of the answer, continued as is; `extra`: more of the template's variables (a request's
    chat_template_kwargs, its thinking switch). A template that does not use tools renders without them."""
    loaded = served.engine.loaded
    if loaded.embeds:
        raise APIError(f"model {served.id!r} is an embedding model: send its inputs to /v1/embeddings", param="model")
    if not loaded.chat.available:
        raise APIError(f"model {served.id!r} has no chat template: send a raw prompt to /v1/completions instead", param="model")
    check_room(served, session, [messages, prefill], "messages")

    def render() -> list[int]:
        try:
            return encode_in_room(served, session, render_chat(loaded, messages, tools=tools, prefill=prefill, extra=extra))
        except RoomError as exc:
            raise room_error(exc, "messages") from None

    return await off_loop(render, size=chars([messages, prefill, tools, extra]))


def render_chat(loaded: LoadedModel, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None, prefill: str | None = None,
                add_generation_prompt: bool = True, extra: dict[str, Any] | None = None) -> str:
    """The text a chat feeds: messages (and tools) through the model's template (`extra`: more of its variables), then
    `prefill`, the start of the answer, as is (on a prompt thread). A template that fails is a 400 naming messages."""
    try:
        text = loaded.chat.render(messages, add_generation_prompt=add_generation_prompt, tools=tools, **(extra or {}))
    except ChatTemplateError as exc:
        raise APIError(f"messages: {exc}", param="messages") from None
    return text + (prefill or "")


def start(served: ServedModel, spec: Generation, *, param: str, follows: Request | None = None, hold: bool = False) -> Outbox:
    """Submit to the model's engine (Outbox: `follows`, `hold`). A prompt that does not fit, or bad ids, is a 400 naming `param`."""
    if served.engine.loaded.embeds:
        raise APIError(f"model {served.id!r} is an embedding model: send its inputs to /v1/embeddings", param="model")
    try:
        return Outbox(served.engine, spec, follows=follows, hold=hold)
    except RoomError as exc:
        raise room_error(exc, param) from None
    except ValueError as exc:
        raise APIError(f"{param}: {exc}", param=param) from None


def sampling_params(**kw: Any) -> SamplingParams:
    """SamplingParams whose ValueError (naming the field) becomes a 400."""
    try:
        return SamplingParams(**kw)
    except ValueError as exc:
        field = str(exc).split(" ", 1)[0]
        raise APIError(str(exc), param=field) from None


def request_options(f: Fields) -> dict[str, Any]:
    """The fields every dialect takes beyond its own, as Generation's keywords: vLLM's `ignore_eos` (keep going past
    end of sequence: benchmarks) and, in the `jitllm` object, speculative decoding's say: `speculative` (false: none
    for this request; true: draft_max guesses every step, whether or not they pay) and `draft_max` (the most tokens it
    guesses a step)."""
    out: dict[str, Any] = {"ignore_eos": f.boolean("ignore_eos")}
    options = f.object("jitllm")
    if options is not None and options.has("speculative"):
        out["speculative"] = options.boolean("speculative")
    if options is not None and options.has("draft_max"):
        out["draft_max"] = options.integer("draft_max", low=0, high=64)
    return out


def tool_grammar(served: ServedModel, tools: list[dict[str, Any]], name: str | None, param: str) -> GrammarSpec:
    """A reply that is a call of one of the tools (of `name` only, when given) in the model's own call format: a
    Hermes <tool_call> block where the vocabulary has that token (Qwen-style templates), bare JSON otherwise; its
    arguments valid against the tool's parameters (tool_choice "required" or a named function)."""
    defs: dict[str, Any] = {}  # every tool's $defs, lifted to the root where their "#/$defs/..." references point
    calls = [
        {"type": "object", "properties": {"name": {"const": fn["name"]}, "arguments": _lift_defs(fn.get("parameters") or {"type": "object"}, defs, fn["name"])},
         "required": ["name", "arguments"], "additionalProperties": False}
        for fn in (t["function"] for t in tools) if name is None or fn["name"] == name
    ]
    if not calls:
        raise APIError(f"{param}: no tool is named {name!r}", param=param)
    schema: dict[str, Any] = calls[0] if len(calls) == 1 else {"anyOf": calls}
    if defs:
        schema = {**schema, "$defs": defs}
    if served.engine.loaded.tokenizer.token_id("<tool_call>") is None:
        return GrammarSpec(schema=schema)
    return GrammarSpec(lark='start: <tool_call> "\\n" call "\\n" </tool_call>\ncall: %json ' + json.dumps({**schema, "x-guidance": COMPACT_JSON}))


def check_tool_schema(schema: Fields) -> None:
    """A tool's parameters schema, as far as this server reads it itself: its $defs and definitions, where given, are
    objects of schemas (the grammar of a forced call lifts them); the rest is llguidance's to judge."""
    for key in ("$defs", "definitions"):
        defs = schema.object(key)
        if defs is None:
            continue
        for name, value in defs.obj.items():
            if not isinstance(value, (dict, bool)):
                raise defs.error(name, "expected a schema (an object or a boolean)")


def _lift_defs(schema: dict[str, Any], defs: dict[str, Any], tool: str) -> dict[str, Any]:
    """`schema` without its $defs (definitions), which join `defs`; a name another tool took with other content is
    renamed (tool__name) and its references with it."""
    own = {**schema.get("definitions", {}), **schema.get("$defs", {})}
    if not own:
        return schema
    renamed = {k: k if defs.get(k, v) == v else f"{tool}__{k}" for k, v in own.items()}

    def fix(node: Any) -> Any:
        if isinstance(node, dict):
            out = {k: fix(v) for k, v in node.items() if k not in ("$defs", "definitions")}
            ref = out.get("$ref")
            if isinstance(ref, str):
                for prefix in ("#/$defs/", "#/definitions/"):
                    if ref.startswith(prefix) and ref[len(prefix):] in renamed:
                        out["$ref"] = "#/$defs/" + renamed[ref[len(prefix):]]
            return out
        if isinstance(node, list):
            return [fix(v) for v in node]
        return node

    for k, v in own.items():
        defs[renamed[k]] = fix(v)
    return fix(schema)


async def constraints(served: ServedModel, spec: GrammarSpec | None, n: int, param: str) -> list[Constraint | None]:
    """n matchers of `spec` (none without one), compiled on a prompt thread (the model's first also builds the
    grammar side of its vocabulary, a few seconds). A schema or grammar llguidance refuses is a 400 naming `param`."""
    if spec is None:
        return [None] * n
    grammars = served.engine.loaded.grammars
    try:
        return await off_loop(lambda: [grammars.constraint(spec) for _ in range(n)])
    except GrammarError as exc:
        raise APIError(f"{param}: {exc}", param=param) from None
