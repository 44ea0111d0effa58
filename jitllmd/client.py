"""The Connect client of a running server: the generated service stubs for one -addr, and their errors as one line."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from connectrpc.errors import ConnectError
    from google.protobuf.message import Message

__all__ = ["DEFAULT_ADDR", "Client", "base_url", "to_dict"]

DEFAULT_ADDR = "127.0.0.1:8080"
DEFAULT_PORT = 8080


def base_url(addr: str) -> str:
    """`HOST:PORT`, `:PORT` (the loopback), `HOST` (port 8080) or an http(s):// URL -> the URL the stubs call."""
    addr = addr.strip()
    if addr.startswith(("http://", "https://")):
        return addr.rstrip("/")
    host, sep, port = addr.rpartition(":")
    if not sep or host.endswith(":"):  # no port, or a bare IPv6 address
        host, port = addr, str(DEFAULT_PORT)
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"-addr {addr!r}: expected HOST:PORT, :PORT or an http:// URL")
    if host in ("", "0.0.0.0", "[::]"):  # what `serve -addr :PORT` listens on, reached over the loopback
        host = "127.0.0.1"
    return f"http://{host}:{port}"


def to_dict(msg: Message) -> dict[str, Any]:
    """A response as JSON-ready data: snake_case keys, every field present (64-bit integers are strings)."""
    from google.protobuf.json_format import MessageToDict

    return MessageToDict(msg, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)


class _Key:
    """A metadata interceptor: every call carries the server's API key."""

    def __init__(self, key: str) -> None:
        self.header = f"Bearer {key}"

    def on_start_sync(self, ctx: Any) -> None:
        ctx.request_headers["authorization"] = self.header

    def on_end_sync(self, token: None, ctx: Any, error: Exception | None) -> None:
        return


class Client:
    """The six sync service clients of one server; build it from -addr (and its API key, if it asks for one)."""

    def __init__(self, addr: str = DEFAULT_ADDR, api_key: str | None = None) -> None:
        from pyqwest import SyncClient

        from .gen.jitllm.v1 import (
            device_connect,
            inference_connect,
            model_connect,
            placement_connect,
            session_connect,
            telemetry_connect,
        )

        self.url = base_url(addr)
        self.where = self.url.removeprefix("http://")
        self.has_key = bool(api_key)
        http = SyncClient()  # one connection pool for all six
        opts: dict[str, Any] = {"send_compression": None, "http_client": http, "interceptors": [_Key(api_key)] if api_key else []}
        self.models = model_connect.ModelServiceClientSync(self.url, **opts)
        self.devices = device_connect.DeviceServiceClientSync(self.url, **opts)
        self.sessions = session_connect.SessionServiceClientSync(self.url, **opts)
        self.placement = placement_connect.PlacementServiceClientSync(self.url, **opts)
        self.inference = inference_connect.InferenceServiceClientSync(self.url, **opts)
        self.telemetry = telemetry_connect.TelemetryServiceClientSync(self.url, **opts)

    def explain(self, exc: ConnectError) -> str:
        """One line for a failed call: `no server at ADDR` when nothing answered, else the server's message."""
        from connectrpc.code import Code

        # the transport's failures come back raised from its own exception; a server's errors have no cause
        cause = exc.__cause__
        if isinstance(cause, ConnectionError) or (exc.code == Code.UNAVAILABLE and isinstance(cause, OSError)):
            return f"no server at {self.where}"
        message = (exc.message or "").strip()
        if cause is not None and exc.code in (Code.UNAVAILABLE, Code.DEADLINE_EXCEEDED):
            return f"{self.where}: {message or exc.code.name.lower()}"
        if exc.code == Code.UNAUTHENTICATED:
            if self.has_key:
                return f"{self.where} refused the API key (-api-key or JITLLMD_API_KEY): {message}"
            return f"{self.where} asks for an API key: pass -api-key KEY or set JITLLMD_API_KEY"
        if exc.code == Code.UNIMPLEMENTED and not message:
            return f"{self.where} does not implement this call (is it a jitllmd server?)"
        return message or exc.code.name.lower()
