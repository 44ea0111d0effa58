"""Serving the app with hypercorn on a listening socket: until SIGINT/SIGTERM (graceful), or on a thread until stopped."""

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

from . import http2

__all__ = ["GRACE_SECONDS", "STOP_SECONDS", "ServerThread", "bind", "host_name", "is_loopback", "parse_addr", "run_server"]

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

    def on_signals(loop: asyncio.AbstractEventLoop, shut_down: Callable[[str, bool], None]) -> None:
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, shut_down, signal.Signals(signum).name, False)

    failed: list[BaseException] = []
    asyncio.run(_serve(app, _config(sock), cancel_all, startup, failed, on_signals))
    if failed:
        raise failed[0]


class ServerThread:
    """The app served as run_server serves it, on a thread with its own event loop and no signal handlers, for a
    program that serves beside its own work (the tests' in-process servers). stop() does what a second signal does:
    no new connections, in-flight requests cancelled, each stream still ended properly."""

    def __init__(self, app: ASGIApp, sock: socket.socket, *, cancel_all: Callable[[], None]):
        config = _config(sock)
        attached = threading.Event()
        self._stop: Callable[[], object] = lambda: None
        self._failed: list[BaseException] = []

        def attach(loop: asyncio.AbstractEventLoop, shut_down: Callable[[str, bool], None]) -> None:
            self._stop = lambda: loop.call_soon_threadsafe(shut_down, "stop", True)
            attached.set()

        def run() -> None:
            try:
                asyncio.run(_serve(app, config, cancel_all, None, self._failed, attach))
            except BaseException as exc:  # raised by stop(), or here when the loop never started
                self._failed.append(exc)
            finally:
                attached.set()

        self._thread = threading.Thread(target=run, name="jitllmd-server", daemon=True)
        self._thread.start()
        attached.wait()
        if self._failed:
            raise self._failed[0]

    def stop(self, timeout: float | None = None) -> bool:
        """Stop serving and wait up to `timeout` seconds for the thread to end (-> whether it ended); what ended the
        serving loop with an error is raised here."""
        if self._thread.is_alive():
            self._stop()
        self._thread.join(timeout)
        if self._failed:
            raise self._failed[0]
        return not self._thread.is_alive()


def _config(sock: socket.socket) -> Config:
    http2.install()  # a body sent after its stream's early answer (401, 404) must not close the connection's other streams
    config = Config()
    config.bind = [f"fd://{sock.detach()}"]  # hypercorn owns the descriptor from here and closes it
    config.keep_alive_max_requests = 1 << 30  # the default 1000 drops an in-flight call every thousand requests
    config.graceful_timeout = GRACE_SECONDS + ENGINE_SECONDS + CLOSE_SECONDS
    config.accesslog = None
    config.errorlog = log
    return config


async def _serve(app: ASGIApp, config: Config, cancel_all: Callable[[], None], startup: Callable[[], None] | None,
                 failed: list[BaseException], attach: Callable[[asyncio.AbstractEventLoop, Callable[[str, bool], None]], None]) -> None:
    """Serve until shut down. `attach(loop, shut_down)` hands out how to stop: shut_down(why, now) from the loop's
    thread (a signal handler); the first call without `now` gives in-flight requests their grace."""
    from .outbox import end_streams  # the engine's side (torch): not before `serve` has checked its flags

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()

    def end_the_rest() -> None:
        if n := end_streams():
            log.warning("%d generation%s not ended by %s engine in %gs: ended by the server", n, "s" if n > 1 else "", "their" if n > 1 else "its", ENGINE_SECONDS)

    def cancel() -> None:
        cancel_all()
        loop.call_later(ENGINE_SECONDS, end_the_rest)

    def shut_down(why: str, now: bool) -> None:
        if not stop.is_set() and not now:
            log.info("%s: shutting down; in-flight requests have %gs to finish (again to cancel them now)", why, GRACE_SECONDS)
            stop.set()
            loop.call_later(GRACE_SECONDS, cancel)
        else:
            log.info("%s: cancelling in-flight requests", why)
            stop.set()
            cancel()

    attach(loop, shut_down)
    if startup is not None:

        def start() -> None:
            try:
                startup()
            except BaseException as exc:  # handed to run_server's caller, once the server has stopped
                failed.append(exc)
                loop.call_soon_threadsafe(stop.set)

        threading.Thread(target=start, name="startup", daemon=True).start()
    await hypercorn_serve(app, config, shutdown_trigger=stop.wait)  # type: ignore[arg-type]
