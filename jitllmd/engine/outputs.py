"""A step's output side: each sampled token taken (end of sequence, stop strings, length) and handed out as events,
and a request's end (its session freed, its counters counted, its last event sent)."""

from __future__ import annotations

import time

import torch

from .draft import Speculator
from .figures import Figures
from .loader import LoadedModel
from .request import Delta, Done, Failed, FinishReason, Request, RequestState
from .sampler import TokenLogprobs, logprobs_of
from .scheduler import Row, Scheduler
from .stats import EngineStats
from .text import release

__all__ = ["Outputs", "request_figures"]


def request_figures(req: Request, loaded: LoadedModel) -> Figures:
    """The figures of a generation that ended (or is ending now)."""
    return Figures.build(loaded.where(), session_id=req.session.id, arrival=req.t_arrival, first_step=req.t_first_step, first_token=req.t_first_token,
                         last_token=req.t_last_token, queue_depth=req.queue_depth_on_entry, generated=len(req.output_ids),
                         bytes_per_token=int(req.decode_bytes / req.decode_steps) if req.decode_steps else 0,
                         drafted=req.spec.drafted if req.spec else 0, accepted=req.spec.accepted if req.spec else 0)


class Outputs:
    """Turns a model's sampled tokens into each request's events. Only the engine thread calls it."""

    def __init__(self, loaded: LoadedModel, scheduler: Scheduler, stats: EngineStats):
        self.loaded = loaded
        self.scheduler = scheduler
        self.stats = stats
        self.eos = frozenset(loaded.eos_token_ids)
        self.speculator: Speculator | None = None  # the engine's, where it drafts (its counts)

    def postprocess(self, rows: list[Row], logits: torch.Tensor, weight_bytes: float) -> None:
        """Sample each row that finished its prompt or decodes, and hand out what it produced; then the full pages the
        step made enter the prefix cache."""
        self._sample(rows, logits, weight_bytes)
        if self.scheduler.prefix_cache:
            self._publish(rows)

    def _publish(self, rows: list[Row]) -> None:
        """Each row's session's new full pages into the prefix cache (not where other ranks hold layers: theirs have none)."""
        runner = self.loaded.runner
        if runner is not None and runner.placement.remotes:
            self.scheduler.prefix_cache = False
            return
        for row in rows:
            if row.ids:
                row.req.session.publish()

    def _sample(self, rows: list[Row], logits: torch.Tensor, weight_bytes: float) -> None:
        now = time.perf_counter()
        num_rows = sum(1 for row in rows if not row.req.cancel_requested)
        j = 0
        for row in rows:
            req = row.req
            mine, j = logits[j : j + row.logits], j + row.logits
            if req.cancel_requested:
                self.finish(req, FinishReason.CANCELLED)
                continue
            if req.state is RequestState.PREFILL and req.prompt_logprobs is not None:
                self._score_prompt(req, mine)
            if req.state is RequestState.PREFILL and req.prompt_left > 0:
                continue  # more prompt to feed next step
            if req.state is RequestState.DECODE:
                req.decode_bytes += weight_bytes / num_rows + req.session.kv.bytes_at(req.session.kv.length)
                if row.draft:
                    req.decode_steps += self.verify(req, row, mine, now)
                    continue
                req.decode_steps += 1
            elif req.followers:  # the prompt ran once for them too
                self._fork(req, mine[-1], now)
            if req.state is RequestState.PREFILL and req.max_tokens == 0:  # the prompt alone (scored, for echo)
                self.finish(req, FinishReason.LENGTH)
                continue
            token = req.sampler.sample(mine[-1])
            self._stamp(req, now)
            req.state = RequestState.DECODE
            self._accept(req, token)

    def verify(self, req: Request, row: Row, logits: torch.Tensor, now: float) -> int:
        """A drafting row's step: row i of `logits` follows its token and guesses 0..i-1. Each guess the sampler's pick
        equals is taken (Sampler.sample: speculative sampling's rule for these deterministic guesses) and lets the next
        row's pick count too; the first refused is replaced by that pick, and a row whose every guess was taken gets
        one more. The KV and the session's tokens go
        back to what those picks followed. Returns the tokens taken."""
        draft, taken, accepted = row.draft, 0, 0
        for i in range(len(draft) + 1):
            guess = draft[i] if i < len(draft) else None
            token = req.sampler.sample(logits[i])
            self._stamp(req, now)
            taken += 1
            accepted += token == guess
            self._accept(req, token)
            if req.finished or token != guess:
                break
        kept = row.pos + taken  # the row's token and the guesses taken: what the picks followed
        req.session.kv.truncate(kept)
        del req.session.token_ids[kept:]
        if self.speculator is not None:
            self.speculator.verified(req, len(draft), accepted)
        return taken

    def _fork(self, leader: Request, logits: torch.Tensor, now: float) -> None:
        """The leader's prompt just ran: each follower gets a copy of its KV and samples its own first token from the
        same logits (then decodes as a row of its own); where the KV cannot be copied, it runs the prompt itself."""
        for f in leader.followers:
            if f.finished or f.forked:
                continue
            if not leader.session.kv.forkable():  # a window layer has already dropped the prompt's start
                f.leader = None
                continue
            f.session.kv.copy_from(leader.session.kv, len(leader.prompt_ids))
            f.session.token_ids[:] = leader.prompt_ids
            f.session.short = leader.session.short  # and how they were made
            f.fed = f.cached = len(f.prompt_ids)  # held, not fed: the leader fed it
            f.t_first_step = leader.t_first_step
            f.prompt_scores = list(leader.prompt_scores)
            f.forked = True
            if f.max_tokens == 0:
                self.finish(f, FinishReason.LENGTH)
                continue
            token = f.sampler.sample(logits)
            self._stamp(f, now)
            self._accept(f, token)

    def _score_prompt(self, req: Request, logits: torch.Tensor) -> None:
        """The log probabilities of the prompt tokens this step's logits predict (row i predicts the token after the
        i-th fed); the prompt's first token has none."""
        if not req.prompt_scores:
            req.prompt_scores.append(None)
        first = req.fed - logits.shape[0] + 1  # the prompt index row 0 predicts
        top = req.prompt_logprobs or 0
        for i in range(logits.shape[0]):
            if first + i < len(req.prompt_ids):
                req.prompt_scores.append(logprobs_of(logits[i], req.prompt_ids[first + i], top))

    def _prompt_scores(self, req: Request) -> list[TokenLogprobs | None] | None:
        """The scored prompt, once: on the first event after it."""
        if req.prompt_logprobs is None or req.prompt_scores_sent:
            return None
        req.prompt_scores_sent = True
        return req.prompt_scores

    def _stamp(self, req: Request, now: float) -> None:
        """A sampled token's time: the first one's wait since arrival, or its gap after the last, to the latency histograms."""
        if req.t_first_token is None:
            req.t_first_token = now
            self.stats.token(now - req.t_arrival, first=True)
        elif req.t_last_token is not None:
            self.stats.token(now - req.t_last_token, first=False)
        req.t_last_token = now

    def _accept(self, req: Request, token: int) -> None:
        """Take a sampled token: end of sequence, text (watching for stop strings), or length."""
        req.sampler.accept(token)
        if token in self.eos and not req.ignore_eos:
            self.finish(req, FinishReason.STOP)
            return
        req.output_ids.append(token)
        self.stats.generated_tokens += 1
        req.held += req.detok.add(token)
        if self._release(req, final=False):
            return
        constraint = req.sampler.constraint
        if constraint is not None and constraint.done:  # the grammar is complete: only end of sequence could follow
            self.finish(req, FinishReason.STOP)
            return
        if len(req.output_ids) >= req.max_tokens:
            self.finish(req, FinishReason.LENGTH)
            return
        req.next_token = token

    def _release(self, req: Request, final: bool) -> bool:
        """Emit held text up to any stop string (engine/text.py). True when a stop string ended the request."""
        r = release(req.held, req.stop, final)
        req.held = r.held
        if r.stop is not None:
            if r.text:
                req.emit(Delta(r.text, [], prompt_logprobs=self._prompt_scores(req)))
            self.finish(req, FinishReason.STOP, stop=r.stop)
            return True
        if r.text or not final:
            scores = [req.sampler.last] if req.sampler.last is not None and not final else None
            req.emit(Delta(r.text, [] if final else [req.output_ids[-1]], scores, self._prompt_scores(req)))
        return False

    def finish(self, req: Request, reason: FinishReason, stop: str | None = None) -> None:
        if req.finished:
            return
        if stop is None:
            req.held += req.detok.flush()
            if req.held and self._release(req, final=True):
                return  # the flushed text held a stop string; _release finished the request
        self._end(req)
        self.stats.finished(cancelled=reason is FinishReason.CANCELLED, reason=reason.value, seconds=time.perf_counter() - req.t_arrival)
        thought = req.sampler.thought  # an end of sequence inside the thought was counted there, but is no output token
        reasoning = min(thought.reasoning_tokens, len(req.output_ids)) if thought is not None else 0
        req.emit(Done(reason, len(req.prompt_ids), len(req.output_ids), len(req.prompt_ids) - req.cached, stop, request_figures(req, self.loaded),
                      self._prompt_scores(req), reasoning))

    def fail(self, req: Request, message: str, unavailable: bool = False) -> None:
        if req.finished:
            return
        req.session.reset()  # its cache may be half written
        self._end(req)
        self.stats.finished(failed=True, seconds=time.perf_counter() - req.t_arrival)
        req.emit(Failed(message, unavailable))

    def refuse(self, req: Request, message: str) -> None:
        """A request that never ran ends with `message`; its session keeps what it held."""
        if req.finished:
            return
        self._end(req)
        self.stats.finished(failed=True, seconds=time.perf_counter() - req.t_arrival)
        req.emit(Failed(message))

    def _end(self, req: Request) -> None:
        if req.state is not RequestState.WAITING:  # admitted: it holds its session
            req.session.busy = False
        for f in req.followers:  # ended before its prompt ran: they run it themselves
            if not f.forked:
                f.leader = None
        req.session.reserved = False  # a pooled slot is free for the next request
        req.state = RequestState.FINISHED
        self.scheduler.remove(req)
