"""Which rows run in the next step, and admission: what each row feeds (a prompt's first step reuses what its session
already holds; a short feed multiplies as decode rows do). Pure bookkeeping over requests and sessions, no tensors."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from .request import Request, RequestState

__all__ = ["Row", "Scheduler"]


@dataclass(frozen=True)
class Row:
    """One request's part of a step, admitted: the tokens it feeds and how (the runner packs these into tensors)."""

    req: Request
    ids: list[int]  # a decode row's sampled token, or the next of a joining prompt; none: a row cancelled meanwhile
    pos: int  # where they go in its session: its KV's length now
    prompt: bool  # prompt tokens, not a decode row's token
    short: bool  # prompt tokens of a short feed: a layer's fused call, each token a row (layers/quant.py)
    many: bool  # ... a short feed past the few-row kernel's figure: its products a prompt chunk's (layers/quant.py)
    logits: int  # logits rows it takes from the step: 0, 1 (its last token's), or one per token fed (a scored prompt, a draft)
    draft: tuple[int, ...] = ()  # a decode row's guesses after its token (engine/speculative.py), verified by Outputs


class Scheduler:
    """Requests wait in arrival order; up to `max_batch` run as rows. Each step a generating row feeds one
    token and joining rows share `prompt_chunk` prompt tokens, first come first served."""

    def __init__(self, max_batch: int = 1, prompt_chunk: int = 512):
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if prompt_chunk < 1:
            raise ValueError(f"prompt_chunk must be >= 1, got {prompt_chunk}")
        self.max_batch = max_batch
        self.prompt_chunk = prompt_chunk
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.prefix_cache = False  # a prompt may start from the model's cached pages of another session's (engine/pages.py)
        self.fits: Callable[[Request, list[Request]], bool] | None = None  # -kv-mem: whether a request's pages fit now

    def add(self, req: Request) -> None:
        req.queue_depth_on_entry = len(self.waiting) + len(self.running)
        self.waiting.append(req)

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    def schedule(self) -> list[tuple[Request, int]]:
        """Admit what fits, then the rows of the next step as (request, tokens to feed)."""
        self.running = [r for r in self.running if not r.finished]
        self._admit()
        rows: list[tuple[Request, int]] = []
        budget = self.prompt_chunk
        for req in self.running:
            if req.state is RequestState.DECODE:
                rows.append((req, 1))
            elif budget > 0:
                n = min(req.prompt_left, budget)
                budget -= n
                rows.append((req, n))
        return rows

    def feed(self, rows: list[tuple[Request, int]], short_feed: int = 0, rows_feed: int = 0) -> list[Row]:
        """What each scheduled row feeds this step: a decode row its sampled token, a joining one the next `n` of its
        prompt (its first step reuses what its session already holds). Advances each request's prompt position and
        its session's tokens. `short_feed`, `rows_feed`: the model's (ModelRunner's; see _short)."""
        out = []
        now = time.perf_counter()
        for req, n in rows:
            if req.cancel_requested:
                out.append(Row(req, [], req.session.kv.length, False, False, False, 0))
                continue
            if req.t_first_step is None:
                req.t_first_step = now
                req.session.kv.fill()  # its pages, where an idle spell sent them out of the pool (kv_spill.py)
                req.session.kv.used = now
                scored = req.prompt_logprobs is not None  # every prompt token is fed, to score the next one
                req.cached = req.session.reuse_prefix(req.prompt_ids[:1] if scored else req.prompt_ids, self.prefix_cache, short_feed)
                req.fed = req.cached
                n = min(n, req.prompt_left)
            prompt = req.state is not RequestState.DECODE
            ids = req.prompt_ids[req.fed : req.fed + n] if prompt else [req.next_token]
            pos = req.session.kv.length
            short, many = self._short(req, pos, len(ids), short_feed, rows_feed) if prompt else (False, False)
            req.session.token_ids.extend(ids)
            if prompt and req.prompt_logprobs is not None:
                logits = len(ids)  # each scores the prompt's next token (the last: the first sampled)
            else:
                logits = 1 if not prompt or req.fed + len(ids) == len(req.prompt_ids) else 0
            if req.state is RequestState.PREFILL:
                req.fed += len(ids)
            out.append(Row(req, ids, pos, prompt, short, many, logits))
        return out

    @staticmethod
    def _short(req: Request, pos: int, n: int, short_feed: int, rows_feed: int) -> tuple[bool, bool]:
        """Whether a prompt chunk's `n` tokens (at `pos`) are a short feed's, where quantized weights run the kernels
        (short_feed > 0): those of a feed of at most short_feed new tokens (a follow-up turn, a short prompt), which
        run as decode rows do (a layer's fused call: layers/quant.py); and whether they are `many`: a feed of more
        than rows_feed, whose products are a prompt chunk's rather than the few-row kernel's. Decided from the request's
        own counts. But a feed of one token is a prompt cached but for its last (a request repeated, regenerated):
        that token is made the way it was made the first time (`Session.short`), so its first sampled token is the
        one that run sampled (a near tie of a small model's logits can turn on the rounding of its activations)."""
        feed = len(req.prompt_ids) - req.cached
        if not short_feed or feed > short_feed:
            return False, False
        session = req.session
        a, b, many = session.short
        if feed == 1 and not a <= pos < b:
            return False, False
        if feed > 1:
            many = feed > rows_feed
        session.short = (a if req.fed > req.cached else pos, pos + n, many)  # a feed the chunk budget split goes on where it was
        return True, many

    def _admit(self) -> None:
        skipped: list[Request] = []
        while self.waiting and len(self.running) < self.max_batch:
            req = self.waiting.popleft()
            if req.finished:  # cancelled while waiting
                continue
            if req.session.busy or (req.leader is not None and not req.forked):  # its session is in use, or its leader
                skipped.append(req)  # has not run the prompt yet: keep its place in line
                continue
            if self.fits is not None and not self.fits(req, self.running):
                skipped.append(req)  # first come, first served: nothing passes it
                break
            req.session.busy = True
            req.state = RequestState.DECODE if req.forked else RequestState.PREFILL
            self.running.append(req)
        self.waiting.extendleft(reversed(skipped))

    def remove(self, req: Request) -> None:
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
