"""Serving the app with hypercorn on a listening socket, with a graceful shutdown on SIGINT/SIGTERM."""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import signal
import socket
import threading
from collections.abc import Callable

from hypercorn.asyncio import serve as hypercorn_serve
from hypercorn.config import Config
from starlette.types import ASGIApp

__all__ = ["GRACE_SECONDS", "STOP_SECONDS", "bind", "host_name", "is_loopback", "parse_addr", "run_server"]

log = logging.getLogger("jitllmd.serve")

GRACE_SECONDS = 10.0  # in-flight requests get this long to finish after SIGINT/SIGTERM; then they are cancelled
ENGINE_SECONDS = 1.0  # a cancelled stream's engine gets this long to end it; then the server ends it itself
CLOSE_SECONDS = 5.0  # ... and the last bytes this long to leave before the connections close
STOP_SECONDS = 10.0  # then an engine still inside a step has this long to leave it before the process exits anyway


def parse_addr(addr: str) -> tuple[str, int]:
    """'host:port', ':port' (every interface), '[::1]:port' -> (host, port)."""
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"-addr {addr!r}: expected HOST:PORT or :PORT, e.g. 127.0.0.1:8080")
    host = host.strip("[]") or "0.0.0.0"
    return host, int(port)


def host_name(header: str) -> str:
    """The name in a Host header (or -addr), without its port: 'localhost:8080' -> 'localhost', '[::1]:80' -> '::1'."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:].split("]", 1)[0]
    name, sep, port = header.rpartition(":")
    return name if sep and port.isdigit() else header


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bind(host: str, port: int) -> socket.socket:
    """A TCP socket bound to the address (port 0 picks a free one), not yet listening: `serve` binds before it loads
    a model, so an address in use is said at once, and connections are refused until it calls `listen(512)`.
    OSError says why it cannot bind."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, _, _, _, sockaddr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(sockaddr)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def run_server(app: ASGIApp, sock: socket.socket, *, cancel_all: Callable[[], None], startup: Callable[[], None] | None = None) -> None:
    """Serve until SIGINT/SIGTERM. The first signal stops accepting and lets in-flight requests finish for
    GRACE_SECONDS; a second signal (or the end of the grace) cancels them, so every stream still ends properly: its
    engine ends it within ENGINE_SECONDS, or the server does (an engine held inside a long step), with `cancelled`.
    `startup` (loading the start-up models) runs on its own thread while the server already answers; what it raises
    stops the server, and is raised here once it has stopped."""
    config = Config()
    config.bind = [f"fd://{sock.detach()}"]  # hypercorn owns the descriptor from here and closes it
    config.keep_alive_max_requests = 1 << 30  # the default 1000 drops an in-flight call every thousand requests
    config.graceful_timeout = GRACE_SECONDS + ENGINE_SECONDS + CLOSE_SECONDS
    config.accesslog = None
    config.errorlog = log
    failed: list[BaseException] = []
    asyncio.run(_serve(app, config, cancel_all, startup, failed))
    if failed:
        raise failed[0]


async def _serve(app: ASGIApp, config: Config, cancel_all: Callable[[], None], startup: Callable[[], None] | None,
                 failed: list[BaseException]) -> None:
    from .outbox import end_streams  # the engine's side (torch): not before `serve` has checked its flags

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()

    def end_the_rest() -> None:
        if n := end_streams():
            log.warning("%d generation%s not ended by %s engine in %gs: ended by the server", n, "s" if n > 1 else "", "their" if n > 1 else "its", ENGINE_SECONDS)

    def cancel() -> None:
        cancel_all()
        loop.call_later(ENGINE_SECONDS, end_the_rest)

    def on_signal(signum: int) -> None:
        if not stop.is_set():
            log.info("%s: shutting down; in-flight requests have %gs to finish (again to cancel them now)", signal.Signals(signum).name, GRACE_SECONDS)
            stop.set()
            loop.call_later(GRACE_SECONDS, cancel)
        else:
            log.info("%s: cancelling in-flight requests", signal.Signals(signum).name)
            cancel()

    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, on_signal, signum)
    if startup is not None:

        def start() -> None:
            try:
                startup()
            except BaseException as exc:  # handed to run_server's caller, once the server has stopped
                failed.append(exc)
                loop.call_soon_threadsafe(stop.set)

        threading.Thread(target=start, name="startup", daemon=True).start()
    await hypercorn_serve(app, config, shutdown_trigger=stop.wait)  # type: ignore[arg-type]
