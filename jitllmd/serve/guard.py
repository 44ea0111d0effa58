"""What every request passes before a route sees it, as one ASGI middleware: the Host header (a page that renamed
itself to reach the server is refused), the API key, gRPC's need for HTTP/2 and a body that must arrive in time and
within MAX_BODY; and what every response gains: its request id and its count in /metrics."""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import logging
import re
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.routing import Mount
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from . import anthropic, openai
from .body import MAX_BODY, APIError
from .server import host_name

__all__ = ["BODY_RATE", "BODY_SECONDS", "BodyRefused", "Guard"]

log = logging.getLogger("jitllmd.http")

BODY_SECONDS = 10.0  # a request body must start, and keep, arriving: a pause this long in it is a 408 ...
BODY_RATE = 256 << 10  # ... and all of it must arrive within BODY_SECONDS plus a second per this many bytes of its
# Content-Length (a chunked one: of MAX_BODY), so no body holds a connection past BODY_SECONDS + MAX_BODY / BODY_RATE
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")  # a client's own X-Request-Id is kept when it looks like this
_OPEN = ("/healthz",)  # paths no key guards
_GRPC_STATUS = {401: 16, 403: 7, 404: 12, 408: 4, 413: 8, 415: 3, 426: 12}  # HTTP status -> gRPC code, for trailers-only answers
_CONNECT_CODE = {401: "unauthenticated", 403: "permission_denied", 404: "unimplemented", 408: "deadline_exceeded",
                 413: "resource_exhausted"}


class BodyRefused(APIError):
    """The body came too slowly (408) or too big (413): the guard answered, and whichever route read it gets this."""


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


class Guard:
    """api_key: required of every route but /healthz, as `Authorization: Bearer KEY` or `x-api-key: KEY` (compared in
    constant time). allowed_hosts: the names a Host header may carry (IP literals always may); None checks none.
    observe(method, route, status) counts each answered request."""

    def __init__(self, app: ASGIApp, *, api_key: str | None = None, allowed_hosts: frozenset[str] | None = None,
                 observe: Callable[[str, str, int], None] | None = None):
        self.app = app
        self.key = api_key.encode() if api_key else None
        self.hosts = allowed_hosts
        self.observe = observe

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        given = headers.get("x-request-id", "")
        request_id = given if _REQUEST_ID.fullmatch(given) else "req_" + secrets.token_hex(12)
        scope.setdefault("state", {})["request_id"] = request_id
        path, method = scope["path"], scope["method"]
        t0 = time.perf_counter()
        status = 0
        late = False  # the guard refused the body and answered: the route's own answer goes nowhere

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                ids = [(b"x-request-id", request_id.encode()), (b"request-id", request_id.encode())]
                message = {**message, "headers": [*message.get("headers", []), *ids]}
            await send(message)

        async def send_unless_late(message: Message) -> None:
            nonlocal late
            if late:
                return
            if message["type"] == "http.response.start" and message["status"] == 404 and _is_grpc(headers):
                late = True  # an unknown method is UNIMPLEMENTED in gRPC's own terms; the route's 404 goes nowhere
                await _answer(APIError(f"{method} {path}: no such method", kind="not_found"), scope, headers, send_with_id)
                return
            await send_with_id(message)

        async def on_refused(exc: BodyRefused) -> None:
            nonlocal late
            if status == 0:  # the connection cannot carry another request: the rest of the body may still come
                await _answer(exc, scope, headers, send_with_id, close=True)
            late = True

        try:
            refusal = self._refusal(scope, headers)
            if refusal is not None:
                await _answer(refusal, scope, headers, send_with_id)
                return
            declared = _declared(headers)
            if declared is not None and declared > MAX_BODY:  # refused before a byte of it is waited for, on every route
                await _answer(BodyRefused(f"the request body is {declared} bytes; the limit is {MAX_BODY}", kind="too_large"),
                              scope, headers, send_with_id, close=True)
                return
            try:
                await self.app(scope, self._metered(receive, declared, on_refused), send_unless_late)
            except BodyRefused:  # answered already
                pass
        finally:
            ms = (time.perf_counter() - t0) * 1000
            log.info("%s %s %s %s %.0f ms", method, path, status or "-", request_id, ms)
            if self.observe is not None and status:
                self.observe(method, _route(scope, status), status)

    def _refusal(self, scope: Scope, headers: dict[str, str]) -> APIError | None:
        if self.hosts is not None and "host" in headers:
            name = host_name(headers["host"])
            if name not in self.hosts and not _is_ip(name):
                return APIError(f"Host {name!r} is not a name of this server (a web page may have renamed itself to reach it): "
                                f"start the server with -allow-host {name} to accept it", kind="forbidden")
        if _is_grpc(headers) and not headers.get("content-type", "").startswith("application/grpc-web") and scope.get("http_version") != "2":
            return APIError("gRPC needs HTTP/2 and this call came over HTTP/" + scope.get("http_version", "1.1") +
                            ": use cleartext HTTP/2 (h2c, e.g. grpcurl -plaintext), or the Connect or gRPC-Web protocol over HTTP/1.1", kind="http_version")
        if self.key is not None and scope["path"] not in _OPEN:
            auth = headers.get("authorization", "")
            given = [t for t in (auth[7:].strip() if auth[:7].lower() == "bearer " else "", headers.get("x-api-key", "")) if t]
            if not any([hmac.compare_digest(t.encode(), self.key) for t in given]):  # a list: each compared, in constant time
                what = "a wrong API key" if given else "no API key"
                return APIError(f"{what}: send Authorization: Bearer KEY (or x-api-key: KEY) with the key the server was started with",
                                kind="unauthorized", code="invalid_api_key")
        return None

    def _metered(self, receive: Receive, declared: int | None, on_refused: Callable[[BodyRefused], Awaitable[None]]) -> Receive:
        """`receive` that answers (on_refused) and raises BodyRefused, in whichever route reads the body (the Connect
        services read their own), once the body pauses for BODY_SECONDS, is late (BODY_SECONDS plus a second per
        BODY_RATE bytes it declares, or MAX_BODY's) or runs past its Content-Length or MAX_BODY; after the body, waits
        are the route's own."""
        loop = asyncio.get_running_loop()
        limit = MAX_BODY if declared is None else declared
        seconds = BODY_SECONDS + limit / BODY_RATE
        deadline = loop.time() + seconds
        size = 0
        body_done = False

        async def receive_metered() -> Message:
            nonlocal body_done, size
            if body_done:
                return await receive()
            left = deadline - loop.time()
            try:
                message = await asyncio.wait_for(receive(), max(min(left, BODY_SECONDS), 0.0))
            except TimeoutError:
                why = f" within {seconds:.3g} s" if left <= BODY_SECONDS else f": nothing came for {BODY_SECONDS:g} s"
                exc = BodyRefused("the request body did not arrive" + why, kind="timeout")
                await on_refused(exc)
                raise exc from None
            if message["type"] == "http.request":
                size += len(message.get("body", b""))
                if size > limit:
                    what = "its Content-Length" if declared is not None else f"the limit of {MAX_BODY} bytes"
                    exc = BodyRefused(f"the request body runs past {what}", kind="too_large")
                    await on_refused(exc)
                    raise exc
            if message["type"] != "http.request" or not message.get("more_body", False):
                body_done = True
            return message

        return receive_metered


def _declared(headers: dict[str, str]) -> int | None:
    """The body's Content-Length, None where the body is chunked (or has none)."""
    value = headers.get("content-length", "").strip()
    return int(value) if value.isdigit() else None


def _is_grpc(headers: dict[str, str]) -> bool:
    return headers.get("content-type", "").startswith("application/grpc")


def _route(scope: Scope, status: int) -> str:
    """The route a request reached, as a bounded label: a route's template (/v1/models/{model:path}), a Connect or
    gRPC method's path; anything no route took (refused before routing, unknown paths and methods) is `unmatched`."""
    route = scope.get("route")
    if route is None or (isinstance(route, Mount) and status == 404):
        return "unmatched"
    return scope["path"] if isinstance(route, Mount) else getattr(route, "path", "unmatched")


async def _grpc_answer(exc: APIError, scope: Scope, headers: dict[str, str], send: Send, extra: list[tuple[bytes, bytes]]) -> None:
    """A gRPC error with no message: its status in trailers where the server can send them (HTTP/2), else in the
    headers (trailers-only, as gRPC-Web and an HTTP/1.1 caller read it)."""
    media = headers.get("content-type", "application/grpc").split(";")[0].encode()
    status = [(b"grpc-status", str(_GRPC_STATUS.get(exc.status, 2)).encode()), (b"grpc-message", _percent(exc.message).encode())]
    if "http.response.trailers" in scope.get("extensions", {}) and not media.startswith(b"application/grpc-web"):
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", media), *extra], "trailers": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        await send({"type": "http.response.trailers", "headers": status, "more_trailers": False})
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", media), *status, *extra]})
    await send({"type": "http.response.body", "body": b""})


def _percent(text: str) -> str:
    """grpc-message's percent-encoding."""
    return "".join(c if " " <= c <= "~" and c != "%" else "".join(f"%{b:02X}" for b in c.encode()) for c in text)


async def _answer(exc: APIError, scope: Scope, headers: dict[str, str], send: Send, close: bool = False) -> None:
    """An error in the dialect of the path: gRPC, Connect, Anthropic or OpenAI."""
    path = scope["path"]
    extra: list[tuple[bytes, bytes]] = [(b"connection", b"close")] if close and scope.get("http_version", "1.1").startswith("1") else []
    if exc.status == 401:
        extra.append((b"www-authenticate", b"Bearer"))
    if _is_grpc(headers):
        await _grpc_answer(exc, scope, headers, send, extra)
        return
    if path.startswith("/jitllm.v1."):
        body = json.dumps({"code": _CONNECT_CODE.get(exc.status, "invalid_argument"), "message": exc.message}).encode()
        media = b"application/json"
    else:
        resp: Any = anthropic.error_response(exc) if path.startswith("/v1/messages") else openai.error_response(exc)
        body, media = resp.body, b"application/json"
    await send({"type": "http.response.start", "status": exc.status,
                "headers": [(b"content-type", media), (b"content-length", str(len(body)).encode()), *extra]})
    await send({"type": "http.response.body", "body": body})
