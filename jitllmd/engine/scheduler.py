"""Which rows run in the next step: pure bookkeeping over requests, no tensors."""

from __future__ import annotations

from collections import deque

from .request import Request, RequestState

__all__ = ["Scheduler"]


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

    def _admit(self) -> None:
        skipped: list[Request] = []
        while self.waiting and len(self.running) < self.max_batch:
            req = self.waiting.popleft()
            if req.finished:  # cancelled while waiting
                continue
            if req.session.busy or (req.leader is not None and not req.forked):  # its session is in use, or its leader
                skipped.append(req)  # has not run the prompt yet: keep its place in line
                continue
            req.session.busy = True
            req.state = RequestState.DECODE if req.forked else RequestState.PREFILL
            self.running.append(req)
        self.waiting.extendleft(reversed(skipped))

    def remove(self, req: Request) -> None:
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
