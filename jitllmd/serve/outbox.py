"""One engine request seen from asyncio: the engine thread's events arrive in the loop; leaving early cancels it."""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any, TypeVar

from starlette.requests import Request as HTTPRequest

from ..engine.engine import Engine
from ..engine.outputs import request_figures
from ..engine.request import Delta, Done, Embedded, Event, Failed, FinishReason, Generation, Request
from ..engine.sampler import TokenLogprobs
from .body import APIError

__all__ = ["Outbox", "collect_all", "embed", "end_streams", "until_disconnect"]

T = TypeVar("T")

_END: Any = object()  # queued by Outbox.end(): read as a Done(cancelled)
_open: weakref.WeakSet[Outbox] = weakref.WeakSet()  # every outbox whose final event has not been read yet


class Outbox:
    """Submit now (the engine's RoomError/ValueError raise here), then `async for ev in outbox`.

    However the iteration ends before Done or Failed (a client that went away, a cancelled task), the engine
    request is cancelled, so its row leaves at the next step and its session is freed. `end()` gives the reader its
    final event from the server's side (a server that must stop while the engine is held inside a step).
    """

    def __init__(self, engine: Engine, spec: Generation, *, follows: Request | None = None, hold: bool = False):
        self.engine = engine
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Event] = asyncio.Queue()  # and _END
        self._events = events
        self._loop = loop
        self._generated = 0  # token ids the reader has been handed
        self.scores: list[TokenLogprobs] = []  # the generated tokens' log probabilities so far, when asked
        self.prompt_scores: list[TokenLogprobs | None] | None = None  # the prompt's, when asked
        self._ended = False  # end() ran, or the reader is done

        def emit(ev: Event) -> None:  # called on the engine thread; holds no reference back to this outbox
            try:
                loop.call_soon_threadsafe(events.put_nowait, ev)
            except RuntimeError:  # the loop is closed: the server is gone, nobody waits for this
                pass

        self.request: Request = engine.submit(spec, emit, follows=follows, hold=hold)
        _open.add(self)

    async def __aiter__(self) -> AsyncGenerator[Event, None]:
        done = False
        try:
            while not done:
                ev = await self._events.get()
                if ev is _END:
                    ev = self._cancelled()
                done = isinstance(ev, (Done, Failed))
                if isinstance(ev, Delta):
                    self._generated += len(ev.token_ids)
                    self.scores += ev.logprobs or []
                if isinstance(ev, (Delta, Done)) and ev.prompt_logprobs is not None:
                    self.prompt_scores = ev.prompt_logprobs
                yield ev
        finally:
            self._ended = True
            _open.discard(self)
            if not done:
                self.engine.cancel(self.request)

    def end(self) -> None:
        """Cancel the request and queue its final event now, `cancelled`, whatever the engine thread is doing: what
        the engine hands out later is never read. Events already queued are read first (one may be the real end)."""
        if self._ended:
            return
        self._ended = True
        self.engine.cancel(self.request)
        self._events.put_nowait(_END)

    def _cancelled(self) -> Done:
        req = self.request  # its engine-side numbers are read without the engine thread, which may be inside a step
        figures = request_figures(req, self.engine.loaded)
        return Done(FinishReason.CANCELLED, len(req.prompt_ids), self._generated, len(req.prompt_ids) - req.cached, None, figures)

    async def collect(self) -> tuple[str, Done]:
        """The whole text and the final event. A Failed event (an engine bug) raises RuntimeError."""
        parts: list[str] = []
        async for ev in self:
            if isinstance(ev, Delta):
                parts.append(ev.text)
            elif isinstance(ev, Done):
                return "".join(parts), ev
            elif isinstance(ev, Failed):
                if ev.unavailable:  # another rank of the model is gone: the client may try again later
                    raise APIError(ev.message, kind="unavailable")
                raise RuntimeError(ev.message)
        raise RuntimeError("the engine ended the request without a final event")


async def collect_all(outboxes: list[Outbox]) -> list[tuple[str, Done]]:
    """Each generation's whole text and final event; when one fails (or the wait is cancelled), the others are
    ended too: nothing runs on for a request that has been answered."""
    try:
        return list(await asyncio.gather(*(o.collect() for o in outboxes)))
    except BaseException:
        for o in outboxes:
            o.end()  # a no-op for those that ended
        raise


def end_streams() -> int:
    """End every open generation of this event loop from the server's side (see Outbox.end). -> how many."""
    loop = asyncio.get_running_loop()
    mine = [o for o in list(_open) if o._loop is loop and not o._ended]
    for o in mine:
        o.end()
    return len(mine)


async def embed(engine: Engine, batch: list[list[int]]) -> Embedded:
    """Run an embedding job on the model's engine thread (its errors raise here, before waiting)."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[Event] = loop.create_future()

    def settle(ev: Event) -> None:
        if not done.done():  # the waiter may have been cancelled
            done.set_result(ev)

    def emit(ev: Event) -> None:  # on the engine thread
        try:
            loop.call_soon_threadsafe(settle, ev)
        except RuntimeError:  # the loop is closed
            pass

    engine.embed(batch, emit)
    ev = await done
    if isinstance(ev, Failed):
        raise RuntimeError(ev.message)
    assert isinstance(ev, Embedded)
    return ev


async def _disconnected(request: HTTPRequest) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnect(request: HTTPRequest, work: Callable[[], Awaitable[T]]) -> T | None:
    """Run `work` (after the body was read); cancel it and return None if the client goes away first."""
    task = asyncio.ensure_future(work())
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (task, watch):
            if not t.done():
                t.cancel()
    if task.cancelled() or not task.done():
        await asyncio.gather(task, return_exceptions=True)
        return None
    return task.result()
