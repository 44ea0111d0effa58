"""Chat templates: render a model's Jinja chat template the way Hugging Face does, in a sandbox."""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.exceptions import SecurityError
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = ["ChatTemplate", "ChatTemplateError"]

_ROLES = ("system", "user", "assistant", "tool")
# Templates read a message's reasoning under different names; every name present gets filled in.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_NO_TEMPLATE = "this model has no chat template; use a completion (no -chat) instead"


class ChatTemplateError(ValueError):
    """A chat template could not be rendered: no template, a broken template, or messages it cannot take."""


class ChatTemplate:
    """A model's chat template, compiled once (on first use) in an immutable Jinja sandbox."""

    def __init__(self, source: str | None, *, bos_token: str | None = None, eos_token: str | None = None):
        self.source = source or None
        self.bos_token = bos_token
        self.eos_token = eos_token
        self._template: jinja2.Template | None = None
        self._content_as_parts = False

    @property
    def available(self) -> bool:
        """Whether the model has a chat template at all."""
        return self.source is not None

    def render(
        self,
        messages: list[dict],
        *,
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        **extra: Any,
    ) -> str:
        """Render `messages` (OpenAI shape) into the prompt text the model was trained on."""
        template = self._compiled()
        context: dict[str, Any] = {}
        # Unset special tokens stay undefined (render as ""), as in transformers; None would render as "None".
        if self.bos_token is not None:
            context["bos_token"] = self.bos_token
        if self.eos_token is not None:
            context["eos_token"] = self.eos_token
        context.update({key: _plain(value, key) for key, value in extra.items()})
        context["messages"] = _normalize_messages(messages, content_as_parts=self._content_as_parts)
        context["tools"] = _normalize_tools(tools)
        context["add_generation_prompt"] = bool(add_generation_prompt)
        try:
            return template.render(context)
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template error: {_one_line(exc)}") from exc
        except Exception as exc:
            raise ChatTemplateError(f"chat template error: {type(exc).__name__}: {_one_line(exc)}") from exc

    def _compiled(self) -> jinja2.Template:
        if self.source is None:
            raise ChatTemplateError(_NO_TEMPLATE)
        if self._template is None:
            env = _environment()
            try:
                ast = env.parse(self.source)
                self._template = env.from_string(ast)
            except jinja2.TemplateSyntaxError as exc:
                message = f"chat template syntax error at line {exc.lineno}: {_one_line(exc.message)}"
                raise ChatTemplateError(message) from exc
            except jinja2.TemplateError as exc:
                raise ChatTemplateError(f"chat template error: {_one_line(exc)}") from exc
            self._content_as_parts = _iterates_content(ast)
        return self._template


class _SandboxedEnvironment(ImmutableSandboxedEnvironment):
    def unsafe_undefined(self, obj: Any, attribute: str) -> jinja2.Undefined:
        # Reaching for private attributes is only ever an escape attempt: fail loudly rather than render "".
        if attribute.startswith("_"):
            raise SecurityError(f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe")
        return super().unsafe_undefined(obj, attribute)


class _GenerationTag(Extension):
    """Accepts transformers' `{% generation %}...{% endgeneration %}` assistant-mask markers; renders the body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


class _TemplateDict:
    """`dict` for templates: construction and `fromkeys` only, no access to the type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any) -> dict:
        return dict.fromkeys(*args)


def _raise_exception(message: Any) -> None:
    raise ChatTemplateError(_one_line(message))


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Unlike Jinja's builtin, no HTML escaping: the output goes to a model, not a browser.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> _SandboxedEnvironment:
    env = _SandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols", _GenerationTag]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    return env


def _one_line(value: Any) -> str:
    return " ".join(str(value).split())


def _content_access(node: nodes.Node | None) -> bool:
    """Whether `node` reads `x.content` or `x['content']`, possibly through filters or tests."""
    while isinstance(node, (nodes.Filter, nodes.Test)):
        node = node.node
    if isinstance(node, nodes.Getattr):
        return node.attr == "content"
    if isinstance(node, nodes.Getitem):
        return isinstance(node.arg, nodes.Const) and node.arg.value == "content"
    return False


def _iterates_content(ast: nodes.Template) -> bool:
    """Whether the template loops over a message's content, i.e. takes OpenAI content parts rather than strings."""
    aliases = {
        node.target.name
        for node in ast.find_all(nodes.Assign)
        if isinstance(node.target, nodes.Name) and _content_access(node.node)
    }
    for loop in ast.find_all(nodes.For):
        source: nodes.Node | None = loop.iter
        while isinstance(source, (nodes.Filter, nodes.Test)):
            source = source.node
        if source is None:
            continue
        if _content_access(source) or (isinstance(source, nodes.Name) and source.name in aliases):
            return True
    return False


def _plain(value: Any, where: str) -> Any:
    """A copy of `value` made of plain JSON types only, so templates never touch caller objects."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        out = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise ChatTemplateError(f"{where} has a non-string key {key!r}")
            out[str.__str__(key)] = _plain(item, f"{where}.{key}")
        return out
    if isinstance(value, (list, tuple)):
        return [_plain(item, f"{where}[{i}]") for i, item in enumerate(value)]
    raise ChatTemplateError(f"{where} has unsupported type {type(value).__name__}")


def _normalize_tools(tools: Any) -> list[dict] | None:
    if tools is None:
        return None
    if not isinstance(tools, (list, tuple)):
        raise ChatTemplateError(f"tools must be a list of objects, not {type(tools).__name__}")
    for i, tool in enumerate(tools):
        if not isinstance(tool, Mapping):
            raise ChatTemplateError(f"tools[{i}] must be an object, not {type(tool).__name__}")
    return _plain(tools, "tools")


def _normalize_messages(messages: Any, *, content_as_parts: bool) -> list[dict]:
    if not isinstance(messages, (list, tuple)):
        raise ChatTemplateError(f"messages must be a list of objects, not {type(messages).__name__}")
    if not messages:
        raise ChatTemplateError("messages is empty")
    return [_normalize_message(message, i, content_as_parts) for i, message in enumerate(messages)]


def _normalize_message(message: Any, i: int, content_as_parts: bool) -> dict:
    where = f"messages[{i}]"
    if not isinstance(message, Mapping):
        raise ChatTemplateError(f"{where} must be an object, not {type(message).__name__}")
    role = message.get("role")
    if not isinstance(role, str):
        raise ChatTemplateError(f"{where}.role must be a string")
    if role not in _ROLES:
        raise ChatTemplateError(f"{where}.role {role!r} is not one of {', '.join(_ROLES)}")
    # Keys set to None are dropped, as transformers does: templates test for presence, and None renders as "None".
    out = {key: _plain(value, f"{where}.{key}") for key, value in message.items() if value is not None}
    if "content" in out:
        out["content"] = _normalize_content(out["content"], f"{where}.content", content_as_parts)
    if "tool_calls" in out:
        if role != "assistant":
            raise ChatTemplateError(f"{where}.tool_calls is only allowed on assistant messages")
        out["tool_calls"] = _normalize_tool_calls(out["tool_calls"], f"{where}.tool_calls")
    for key in ("tool_call_id", "name"):
        if key in out and not isinstance(out[key], str):
            raise ChatTemplateError(f"{where}.{key} must be a string")
    reasoning = next((out[key] for key in _REASONING_FIELDS if key in out), None)
    if reasoning is not None:
        out = {"thinking": reasoning, **out, "reasoning_content": reasoning}
    return out


def _normalize_content(content: Any, where: str, as_parts: bool) -> str | list[dict]:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ChatTemplateError(f"{where} must be a string, null or a list of content parts")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict):
            raise ChatTemplateError(f"{where}[{j}] must be an object")
        if part.get("type") != "text":
            raise ChatTemplateError(f"{where}[{j}].type must be 'text' (only text content is supported)")
        if not isinstance(part.get("text"), str):
            raise ChatTemplateError(f"{where}[{j}].text must be a string")
        texts.append(part["text"])
    if as_parts:
        return [{"type": "text", "text": text} for text in texts]
    return "\n".join(texts)


def _normalize_tool_calls(tool_calls: Any, where: str) -> list[dict]:
    if not isinstance(tool_calls, list):
        raise ChatTemplateError(f"{where} must be a list")
    out = []
    for j, call in enumerate(tool_calls):
        here = f"{where}[{j}]"
        if not isinstance(call, dict):
            raise ChatTemplateError(f"{here} must be an object")
        if call.get("type", "function") != "function":
            raise ChatTemplateError(f"{here}.type must be 'function'")
        if "id" in call and not isinstance(call["id"], str):
            raise ChatTemplateError(f"{here}.id must be a string")
        function = call.get("function")
        if not isinstance(function, dict):
            raise ChatTemplateError(f"{here}.function must be an object")
        if not isinstance(function.get("name"), str):
            raise ChatTemplateError(f"{here}.function.name must be a string")
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            # Templates expect the arguments as a mapping (they tojson it themselves); OpenAI sends a JSON string.
            try:
                parsed = json.loads(arguments)
            except ValueError:
                parsed = None
            if isinstance(parsed, dict):
                function = {**function, "arguments": parsed}
        elif arguments is not None and not isinstance(arguments, dict):
            raise ChatTemplateError(f"{here}.function.arguments must be an object or a JSON string")
        out.append({**call, "function": function})
    return out
