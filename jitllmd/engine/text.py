"""The text side of a generation: what of the detokenized text may go out now, held back while it may be the start
of a stop string, and where a stop string ends it."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Release", "release"]


@dataclass(frozen=True)
class Release:
    """What `release` decided: `text` goes out now, `held` waits for more, `stop` is the stop string that ended the
    generation (None: it goes on)."""

    text: str
    held: str
    stop: str | None = None


def release(text: str, stops: list[str], final: bool) -> Release:
    """Split `text` (held text plus the newest piece) at the first stop string; with none, hold back the longest
    tail that may be becoming one, unless this is the `final` piece."""
    if not stops:
        return Release(text, "")
    hits = [(text.find(s), s) for s in stops if s in text]
    if hits:
        at, s = min(hits)
        return Release(text[:at], "", s)
    if final:
        return Release(text, "")
    keep = max((_overlap(text, s) for s in stops), default=0)
    return Release(text[: len(text) - keep], text[len(text) - keep :])


def _overlap(text: str, stop: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `stop`."""
    for k in range(min(len(text), len(stop) - 1), 0, -1):
        if text.endswith(stop[:k]):
            return k
    return 0
