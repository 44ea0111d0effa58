"""Request bodies: read with a size limit, parse as JSON, take typed fields whose errors name the field; and the
guard that renders a handler's errors in its dialect."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import math
import re
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from ..engine.catalog import ModelLoading

__all__ = ["MAX_BODY", "APIError", "Fields", "dialect", "read_json"]

log = logging.getLogger("jitllmd.serve")
Handler = Callable[[Any, Request], Awaitable[Response]]

MAX_BODY = 32 << 20  # bytes
_OFF_LOOP = 256 << 10  # a body longer than this is parsed on a thread (tens of ms on the event loop otherwise)
_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")  # an escaped or raw UTF-16 surrogate: what makes a string not text
_EXACT_INTEGERS = 1 << 53  # a JSON number written as a float stands for an integer only up to here


class APIError(Exception):
    """A client error: each dialect renders it in its own error shape.

    kind: "invalid_request" (400), "unauthorized" (401), "forbidden" (403), "not_found" (404), "timeout" (408),
    "too_large" (413), "media_type" (415), "http_version" (426: gRPC over HTTP/1.1); "unavailable" (503: the model
    cannot run now, another rank of its blocks being gone); "server" (500) is only for bugs.
    """

    STATUS = {"invalid_request": 400, "unauthorized": 401, "forbidden": 403, "not_found": 404, "timeout": 408, "too_large": 413,
              "media_type": 415, "http_version": 426, "unavailable": 503, "server": 500}

    def __init__(self, message: str, *, param: str | None = None, kind: str = "invalid_request", code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.kind = kind
        self.code = code

    @property
    def status(self) -> int:
        return self.STATUS[self.kind]


def dialect(render: Callable[[APIError], Response]) -> Callable[[Handler], Handler]:
    """A route handler's errors in one dialect's shape: an APIError as the client error it is; anything else is a
    bug: logged, and a generic 500 (never the exception's text)."""

    def decorate(handler: Handler) -> Handler:
        @functools.wraps(handler)
        async def guarded(self: Any, request: Request) -> Response:
            try:
                return await handler(self, request)
            except APIError as exc:
                return render(exc)
            except ModelLoading as exc:  # named a model still loading: a moment from now it answers
                return render(APIError(str(exc), param="model", kind="unavailable"))
            except Exception:
                log.exception("%s %s failed", request.method, request.url.path)
                return render(APIError("internal server error (logged on the server)", kind="server"))

        return guarded

    return decorate


def _no_constant(name: str) -> float:
    raise ValueError(f"{name} is not a JSON number")


async def read_json(request: Request, limit: int = MAX_BODY) -> dict[str, Any]:
    """The body as a JSON object. Refuses a Content-Type other than JSON's, or none (415: what a web page can post
    without asking first, text/plain or a form, never reaches a model), and bodies over `limit` bytes before reading
    them whole. A long body is parsed off the event loop, so other requests (/healthz) are answered meanwhile."""
    given = request.headers.get("content-type")
    if given is None:
        raise APIError("the request has no Content-Type: send Content-Type: application/json", kind="media_type")
    media = given.split(";", 1)[0].strip().lower()
    if media != "application/json" and not (media.startswith("application/") and media.endswith("+json")):
        raise APIError(f"Content-Type {media or '(empty)'!r} is not JSON: send application/json", kind="media_type")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(f"the request body is {int(declared)} bytes; the limit is {limit}", kind="too_large")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(f"the request body is over the limit of {limit} bytes", kind="too_large")
        chunks.append(chunk)
    raw = b"".join(chunks)
    if not raw.strip():
        raise APIError("the request body is empty: send a JSON object")
    body = await asyncio.to_thread(_parse, raw, yielding=True) if len(raw) > _OFF_LOOP else _parse(raw)
    if not isinstance(body, dict):
        raise APIError(f"the request body must be a JSON object, not {_kind(body)}")
    return body


def _parse(raw: bytes, *, yielding: bool = False) -> Any:
    """JSON text -> its value, whose strings are all valid Unicode. `yielding`, on a thread: the C parser holds the GIL
    from start to end unless it calls Python, so Python hooks let the event loop's thread take turns (each call is a
    point where the GIL changes hands), for every object and number."""
    hooks: dict[str, Any] = {"object_hook": _same, "parse_float": _float, "parse_int": _int} if yielding else {}
    try:
        body = json.loads(raw, parse_constant=_no_constant, **hooks)
    except UnicodeDecodeError:
        raise APIError("the request body is not UTF-8 JSON") from None
    except json.JSONDecodeError as exc:
        raise APIError(f"the request body is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    except (ValueError, RecursionError) as exc:
        raise APIError(f"the request body is not valid JSON: {exc}") from None
    if _SURROGATE.search(raw) and not _is_text(body):  # a \ud800-style escape decodes to a lone surrogate, which no tokenizer takes
        raise APIError("the request body holds a lone UTF-16 surrogate escape (such as \\ud800): strings must be valid Unicode")
    return body


def _same(obj: dict[str, Any]) -> dict[str, Any]:
    return obj


def _float(text: str) -> float:
    return float(text)


def _int(text: str) -> int:
    return int(text)


def _is_text(value: Any) -> bool:
    """Whether every string in a parsed JSON value, keys too, is valid Unicode (no lone surrogate): walked in Python,
    so that on a thread it lets the event loop take turns."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            stack.extend(v)
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
        elif isinstance(v, str) and not v.isascii():
            try:
                v.encode()
            except UnicodeEncodeError:
                return False
    return True


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


class Fields:
    """Typed access to a JSON object's fields. `prefix` names where the object sits ("messages[2].")."""

    def __init__(self, obj: Any, prefix: str = ""):
        self.prefix = prefix
        if not isinstance(obj, dict):
            raise APIError(f"{prefix.rstrip('.') or 'the body'} must be an object, not {_kind(obj)}", param=prefix.rstrip(".") or None)
        self.obj = obj

    def name(self, key: str) -> str:
        return self.prefix + key

    def error(self, key: str, message: str) -> APIError:
        return APIError(f"{self.name(key)}: {message}", param=self.name(key))

    def has(self, key: str) -> bool:
        return self.obj.get(key) is not None

    def raw(self, key: str) -> Any:
        return self.obj.get(key)

    def required(self, key: str) -> Any:
        if self.obj.get(key) is None:
            raise self.error(key, "this field is required")
        return self.obj[key]

    def string(self, key: str, default: str | None = None, *, required: bool = False) -> str | None:
        value = self.required(key) if required else self.obj.get(key)
        if value is None:
            return default
        if not isinstance(value, str):
            raise self.error(key, f"expected a string, got {_kind(value)}")
        return value

    def boolean(self, key: str, default: bool = False) -> bool:
        value = self.obj.get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self.error(key, f"expected true or false, got {_kind(value)}")
        return value

    def integer(self, key: str, default: int | None = None, *, low: int | None = None, high: int | None = None, required: bool = False) -> int | None:
        value = self.required(key) if required else self.obj.get(key)
        if value is None:
            return default
        if isinstance(value, float) and value.is_integer() and abs(value) <= _EXACT_INTEGERS:
            value = int(value)  # 3.0; not 1e308, a float no integer field means
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.error(key, f"expected an integer, got {_kind(value)}")
        self._range(key, value, low, high)
        return value

    def number(self, key: str, default: float, *, low: float | None = None, high: float | None = None) -> float:
        value = self.obj.get(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.error(key, f"expected a number, got {_kind(value)}")
        if not math.isfinite(value):
            raise self.error(key, f"expected a finite number, got {value}")  # 1e999 parses as infinity
        self._range(key, value, low, high)
        return float(value)

    def array(self, key: str, *, required: bool = False) -> list[Any] | None:
        value = self.required(key) if required else self.obj.get(key)
        if value is None:
            return None
        if not isinstance(value, list):
            raise self.error(key, f"expected an array, got {_kind(value)}")
        return value

    def text(self, key: str, *, items: str) -> str:
        """A string, or an array of {"type": "text", "text": ...} `items` joined; absent or null is ""."""
        value = self.obj.get(key)
        if value is None:
            return ""
        if isinstance(value, str):
            return value
        if not isinstance(value, list):
            raise self.error(key, f"expected a string or an array of {items}")
        texts = []
        for j, item in enumerate(value):
            t = Fields(item, self.name(f"{key}[{j}]."))
            kind = t.string("type", required=True)
            if kind != "text":
                raise t.error("type", f"{kind!r} {items} are not supported here: this server takes text")
            texts.append(t.string("text", required=True) or "")
        return "".join(texts)

    def strings(self, key: str, *, most: int = 16, single: bool = True) -> list[str]:
        """A string (where `single`) or an array of strings (stop sequences)."""
        value = self.obj.get(key)
        if value is None:
            return []
        if isinstance(value, str) and single:
            return [value]
        if not single and not isinstance(value, list):
            raise self.error(key, f"expected an array of strings, got {_kind(value)}")
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise self.error(key, "expected a string or an array of strings")
        if len(value) > most:
            raise self.error(key, f"at most {most} entries, got {len(value)}")
        return value

    def object(self, key: str) -> Fields | None:
        value = self.obj.get(key)
        if value is None:
            return None
        return Fields(value, self.name(key) + ".")

    def _range(self, key: str, value: float, low: float | None, high: float | None) -> None:
        if low is not None and high is not None and not low <= value <= high:
            raise self.error(key, f"must be between {low:g} and {high:g}, got {value:g}")
        if low is not None and value < low:
            raise self.error(key, f"must be >= {low:g}, got {value:g}")
        if high is not None and value > high:
            raise self.error(key, f"must be <= {high:g}, got {value:g}")
