"""What the engine's inbox carries from other threads to its step loop, one type per kind of message."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from .request import Event, Request
from .sessions import Session

__all__ = ["Cancel", "CancelAll", "EmbedJob", "Job", "Message", "Submit", "Wake"]


@dataclass(frozen=True)
class Submit:
    req: Request
    more: tuple[Request, ...] = ()  # taken in the same drain: its followers (n > 1) are linked before it can run


@dataclass(frozen=True)
class Cancel:
    req: Request


@dataclass(frozen=True)
class CancelAll:
    pass


@dataclass(frozen=True)
class Wake:
    """Nothing to do but look at `_stopping`."""


@dataclass(frozen=True)
class Job:
    """Placement work to run between steps, once `session` has no generation running."""

    work: Callable[[], Any]
    session: Session | None
    future: Future


@dataclass(frozen=True)
class EmbedJob:
    batch: list[list[int]]
    emit: Callable[[Event], None]
    t_arrival: float
    depth: int


Message = Submit | Cancel | CancelAll | Wake | Job | EmbedJob
