"""The step loop of one model on its own thread: pick rows -> run the model -> sample and hand out events."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch

from .calibrate import Calibration, calibrate
from .figures import decode_bytes, request_figures, where
from .joint import JointSteps
from .kv import RoomError, RowSpan, SessionKV
from .loader import LoadedModel, load_model, spendable_bytes
from .placement import HOST
from .request import Delta, Done, Embedded, Event, Failed, FinishReason, Request, RequestState
from .sampler import Sampler, SamplingParams
from .scheduler import Scheduler
from .seam import SeamCandidate, tune_seam
from .sessions import Session, SessionRegistry, common_prefix, new_session_id
from .stats import EngineStats

__all__ = ["Engine"]

log = logging.getLogger("jitllmd.engine")
T = TypeVar("T")
_DEFAULT_PROMPT_CHUNK = 512  # prompt tokens per step of a model with host blocks (a device model measures its own)


class Engine:
    """Runs one loaded model. Thread-safe `submit`/`cancel`; events reach each request's `emit` from the engine thread."""

    def __init__(
        self, loaded: LoadedModel, *, max_batch: int = 1, prompt_chunk: int = 512, joint_steps: str = "auto",
        host_rows: int | None = None, split_rows: int | None = None,
    ):
        self.loaded = loaded
        self.device_rows = max_batch  # rows of a step while every block is on one device
        self.host_rows = max_batch if host_rows is None else host_rows  # requests at once while any block is on the host
        self.split_rows = self.host_rows if split_rows is None else split_rows  # ... while split over devices, none on the host
        self.scheduler = Scheduler(self._rows_now(), prompt_chunk)
        self.joint = JointSteps(joint_steps)
        self.sessions = SessionRegistry()
        self.stats = EngineStats()
        self._inbox: queue.SimpleQueue[tuple[str, Request]] = queue.SimpleQueue()
        self._eos = frozenset(loaded.eos_token_ids)
        self.calibration: Calibration | None = None  # what load measured for -max-batch 0 / -prompt-chunk 0
        self._slots: list[Session] = []  # ephemeral sessions kept for prefix reuse, at most one per row
        self._slots_lock = threading.Lock()
        self._weight_bytes = decode_bytes(loaded)
        self._jobs: list[_Job] = []  # placement changes waiting for their session's generation to end
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._owns_model = False  # loaded by Engine.load: stop() lets go of its weights

    # -- public API -----------------------------------------------------------------------------

    @classmethod
    def load(
        cls, path, *, max_batch: int = 1, prompt_chunk: int = 512, joint_steps: str = "auto", row_limit: int = 1,
        host_rows: int | None = None, split_rows: int | None = None, **load_kw,
    ) -> Engine:
        """Load a model on a new engine thread and run its step loop there.

        Torch's CPU thread pool belongs to the thread that first uses it: loading on one thread and stepping
        on another leaves two pools fighting over the cores (measured: decode 2x slower on 2 cores).
        load_kw go to `load_model` (name, devices, gpu_layers, sessions, max_seq, page_budget, on_progress); its
        errors raise here. A model wholly on one device batches up to max_batch rows: 0 measures the widest decode
        step worth running (at most `row_limit` rows); prompt_chunk 0 measures the prefill chunk (engine/calibrate.py),
        on this same thread. A model with host blocks runs `host_rows` requests at once (default max_batch); one split
        over several devices with none on the host, `split_rows` (-device-concurrency; default host_rows).
        """
        box: dict = {}
        ready = threading.Event()

        def main() -> None:
            try:
                loaded = load_model(path, **load_kw)
                calibration = None
                rows, chunk = max_batch, prompt_chunk
                on_device = loaded.placement is not None and loaded.placement.one_device
                if (rows == 0 or chunk == 0) and on_device:
                    calibration = calibrate(loaded.model, max_rows=rows, row_limit=row_limit, prompt_chunk=chunk, chunk_limit=loaded.max_seq)
                    rows, chunk = calibration.max_rows, calibration.prompt_chunk
                rows = rows or row_limit
                engine = cls(loaded, max_batch=rows, prompt_chunk=chunk or _DEFAULT_PROMPT_CHUNK, joint_steps=joint_steps, host_rows=host_rows, split_rows=split_rows)
                engine.calibration = calibration
                engine._owns_model = True
            except BaseException as exc:  # handed to the caller
                box["error"] = exc
                ready.set()
                return
            engine._thread = threading.current_thread()
            box["engine"] = engine
            ready.set()
            engine._loop()

        threading.Thread(target=main, name=f"engine-{Path(path).name}", daemon=True).start()
        while not ready.wait(0.2):  # a timeout keeps Ctrl-C responsive
            pass
        if "error" in box:
            raise box["error"]
        return box["engine"]

    def start(self) -> Engine:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=f"engine-{self.loaded.name}", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """Cancel everything and end the thread."""
        self._stopping = True
        self._inbox.put(("wake", None))  # type: ignore[arg-type]
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._owns_model:
            self.loaded.close()

    def new_session(self, max_seq: int | None = None) -> Session:
        """A named session that keeps its KV cache across requests."""
        return self.sessions.create(self.loaded.name, self.loaded.new_kv(max_seq))

    def submit(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        emit,
        *,
        max_tokens: int | None = None,
        stop: list[str] | None = None,
        session: Session | None = None,
        ignore_eos: bool = False,
        request_id: str = "",
    ) -> Request:
        """Queue a generation. Raises RoomError when the prompt does not fit the session (both numbers named)."""
        if self.loaded.embeds:
            raise ValueError(f"model {self.loaded.name} is an embedding model: it embeds text, it does not generate")
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        if max_tokens is not None and max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        vocab = self.loaded.tokenizer.vocab_size
        if any(not 0 <= t < vocab for t in prompt_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if session is None:  # ephemeral: never registered; a pooled slot keeps its KV for the next prompt
            session = self._slot(prompt_ids)
        cap, n = session.max_seq, len(prompt_ids)
        if n >= cap:
            raise RoomError(f"the prompt has {n} tokens but the session has room for {cap}: no room is left to generate")
        room = cap - n
        req = Request(
            prompt_ids=list(prompt_ids),
            params=params,
            emit=emit,
            session=session,
            max_tokens=room if max_tokens is None else min(max_tokens, room),
            sampler=Sampler(params, prompt_ids),
            detok=self.loaded.tokenizer.detokenizer(context=prompt_ids[-8:]),
            stop=[s for s in (stop or []) if s],
            ignore_eos=ignore_eos,
            request_id=request_id,
        )
        self._inbox.put(("submit", req))
        return req

    @property
    def slots(self) -> list[Session]:
        """The pooled ephemeral sessions (their KV stays for prefix reuse)."""
        with self._slots_lock:
            return list(self._slots)

    def _slot(self, prompt_ids: list[int]) -> Session:
        """An ephemeral session for a request: the free pooled slot whose cached tokens share the longest prefix
        with the prompt (so only the rest is fed), a new slot while the pool has fewer than the engine's rows, else
        a fresh session that goes with the request."""
        with self._slots_lock:
            free = [s for s in self._slots if not s.reserved]
            if free:
                best = max(free, key=lambda s: common_prefix(s.token_ids, prompt_ids))
            elif len(self._slots) < self.scheduler.max_batch:
                best = Session(new_session_id(), self.loaded.name, self.loaded.new_kv())
                self._slots.append(best)
            else:
                return Session(new_session_id(), self.loaded.name, self.loaded.new_kv())
            best.reserved = True
            return best

    def embed(self, batch: list[list[int]], emit: Callable[[Event], None]) -> None:
        """Queue an embedding job: `emit(Embedded)` (or Failed) from the engine thread, between steps."""
        if not self.loaded.embeds:
            raise ValueError(f"model {self.loaded.name} generates text; embeddings need an embedding model")
        limit = self.loaded.max_seq
        for i, ids in enumerate(batch):
            if not ids:
                raise ValueError(f"input {i} is empty")
            if len(ids) > limit:
                raise RoomError(f"input {i} has {len(ids)} tokens; the model takes at most {limit}")
        self._inbox.put(("embed", _EmbedJob(batch, emit, time.perf_counter(), self._pending_depth())))  # type: ignore[arg-type]

    def _pending_depth(self) -> int:
        return len(self.scheduler.running) + len(self.scheduler.waiting) + self._inbox.qsize()

    def cancel(self, req: Request) -> None:
        self._inbox.put(("cancel", req))

    def snapshot(self) -> tuple[list[Request], list[Request]]:
        """A snapshot of the running and the waiting requests (waiting in arrival order)."""
        return list(self.scheduler.running), list(self.scheduler.waiting)

    def cancel_all(self) -> None:
        """Cancel every request, waiting or running; each ends with finish reason `cancelled`."""
        self._inbox.put(("cancel_all", None))  # type: ignore[arg-type]

    def generate(self, prompt_ids: list[int], params: SamplingParams, **kw) -> Iterator[Event]:
        """Submit now (errors raise here) and iterate the events in the caller's thread.

        Leaving the iteration early (break, close, KeyboardInterrupt) cancels the request.
        """
        events: queue.SimpleQueue[Event] = queue.SimpleQueue()
        req = self.submit(prompt_ids, params, events.put, **kw)
        return self._iterate(req, events)

    def _iterate(self, req: Request, events: queue.SimpleQueue[Event]) -> Iterator[Event]:
        done = False
        try:
            while not done:
                try:
                    ev = events.get(timeout=0.2)  # a timeout keeps Ctrl-C responsive
                except queue.Empty:
                    continue
                done = isinstance(ev, (Done, Failed))
                yield ev
        finally:
            if not done:
                self.cancel(req)

    # -- the loop -------------------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stopping:
            self._drain(block=self.scheduler.idle and not self._jobs)
            if self._stopping:
                break
            if self._jobs:
                self._run_jobs()
            rows = self.scheduler.schedule()
            if not rows:
                continue
            try:
                logits = self._run(rows)
                self._postprocess(rows, logits)
            except Exception as exc:  # a bug or out of memory: fail these rows, keep serving
                log.exception("step failed")
                for req, _ in rows:
                    self._fail(req, f"internal error in the engine: {type(exc).__name__}")
        for req in list(self.scheduler.running) + list(self.scheduler.waiting):
            self._finish(req, FinishReason.CANCELLED)
        for job in self._jobs:
            job.future.cancel()

    def _drain(self, block: bool) -> None:
        while True:
            try:
                kind, req = self._inbox.get(block=block)
            except queue.Empty:
                return
            block = False
            if kind == "submit":
                self.scheduler.add(req)
            elif kind == "cancel" and not req.finished:
                self._cancel(req)
            elif kind == "embed":
                self._embed(req)  # type: ignore[arg-type]
            elif kind == "job":
                self._jobs.append(req)  # type: ignore[arg-type]
            elif kind == "cancel_all":
                for r in [*self.scheduler.running, *self.scheduler.waiting]:
                    self._cancel(r)
            if self._stopping:
                return

    def _embed(self, job: _EmbedJob) -> None:
        t0 = time.perf_counter()
        try:
            vectors = self.loaded.model.embed(job.batch).float().cpu().numpy()  # type: ignore[attr-defined]
        except Exception as exc:  # a bug or out of memory: fail this job, keep serving
            log.exception("embedding failed")
            self.stats.finished(failed=True)
            job.emit(Failed(f"internal error in the engine: {type(exc).__name__}"))
            return
        t1 = time.perf_counter()
        num_tokens = sum(len(ids) for ids in job.batch)
        self.stats.step(len(job.batch), num_tokens)
        self.stats.finished()
        figures = {
            "session_id": "",
            "queued_ms": round((t0 - job.t_arrival) * 1000, 3),
            "queue_depth_on_entry": job.depth,
            **where(self.loaded),
            "prefill_ms": round((t1 - t0) * 1000, 3),
            "decode_ms": 0.0,
            "decode_tokens_per_second": 0.0,
            "bytes_per_token": int(self._weight_bytes / max(1, num_tokens)),
        }
        job.emit(Embedded(vectors, num_tokens, figures))

    def _cancel(self, req: Request) -> None:
        """A waiting request ends now; a running one leaves its row at the next step."""
        req.cancel_requested = True
        if req.state is RequestState.WAITING:
            self._finish(req, FinishReason.CANCELLED)

    def _run(self, rows: list[tuple[Request, int]]) -> torch.Tensor:
        """One step: every row's tokens packed into one batch. Returns logits of the rows that sample."""
        tokens: list[int] = []
        positions: list[int] = []
        spans: list[RowSpan] = []
        logits_at: list[int] = []
        num_prompt = 0
        now = time.perf_counter()
        for req, n in rows:
            if req.cancel_requested:
                continue
            if req.t_first_step is None:
                req.t_first_step = now
                req.cached = req.session.reuse_prefix(req.prompt_ids)
                req.fed = req.cached
                n = min(n, req.prompt_left)
            if req.state is RequestState.DECODE:
                ids = [req.next_token]
            else:
                ids = req.prompt_ids[req.fed : req.fed + n]
            start, pos = len(tokens), req.session.kv.length
            tokens.extend(ids)
            positions.extend(range(pos, pos + len(ids)))
            spans.append(RowSpan(start, len(ids), req.session.kv))
            req.session.token_ids.extend(ids)
            if req.state is RequestState.DECODE or req.fed + len(ids) == len(req.prompt_ids):
                logits_at.append(len(tokens) - 1)
            if req.state is RequestState.PREFILL:
                req.fed += len(ids)
                num_prompt += len(ids)
        if not spans:
            return torch.empty(0)
        self.stats.step(len(spans), num_prompt)
        decode_only = num_prompt == 0
        joint = self.joint.joint(len(spans), decode_only)
        t0 = time.perf_counter()
        logits = self._forward(tokens, positions, spans, logits_at) if joint else self._forward_each(tokens, positions, spans, logits_at)
        self.joint.record(len(spans), joint, time.perf_counter() - t0, decode_only)
        return logits

    def _forward(self, tokens: list[int], positions: list[int], spans: list[RowSpan], logits_at: list[int]) -> torch.Tensor:
        """Every row in one packed forward: dense layers once over all tokens, attention per row."""
        model = self.loaded.model
        dev = model.device
        return model.forward(
            torch.tensor(tokens, dtype=torch.long, device=dev),
            torch.tensor(positions, dtype=torch.long, device=dev),
            spans,
            torch.tensor(logits_at, dtype=torch.long, device=dev),
        )

    def _forward_each(self, tokens: list[int], positions: list[int], spans: list[RowSpan], logits_at: list[int]) -> torch.Tensor:
        """The rows one after another, each its own forward; logits in the same order as the joint step's."""
        out = []
        for span in spans:
            end = span.start + span.num_tokens
            at = [i - span.start for i in logits_at if span.start <= i < end]
            row = RowSpan(0, span.num_tokens, span.kv)
            logits = self._forward(tokens[span.start : end], positions[span.start : end], [row], at)
            out.append(logits)
        return torch.cat(out) if out else torch.empty(0)

    def _postprocess(self, rows: list[tuple[Request, int]], logits: torch.Tensor) -> None:
        now = time.perf_counter()
        num_rows = sum(1 for req, _ in rows if not req.cancel_requested)
        j = 0
        for req, _ in rows:
            if req.cancel_requested:
                self._finish(req, FinishReason.CANCELLED)
                continue
            if req.state is RequestState.PREFILL and req.prompt_left > 0:
                continue  # more prompt to feed next step
            if req.state is RequestState.DECODE:
                req.decode_steps += 1
                req.decode_bytes += self._weight_bytes / num_rows + req.session.kv.length * req.session.kv.bytes_per_position()
            token = req.sampler.sample(logits[j])
            j += 1
            if req.t_first_token is None:
                req.t_first_token = now
            req.t_last_token = now
            req.state = RequestState.DECODE
            self._accept(req, token)

    def _accept(self, req: Request, token: int) -> None:
        """Take a sampled token: end of sequence, text (watching for stop strings), or length."""
        req.sampler.accept(token)
        if token in self._eos and not req.ignore_eos:
            self._finish(req, FinishReason.STOP)
            return
        req.output_ids.append(token)
        self.stats.generated_tokens += 1
        req.held += req.detok.add(token)
        if self._release(req, final=False):
            return
        if len(req.output_ids) >= req.max_tokens:
            self._finish(req, FinishReason.LENGTH)
            return
        req.next_token = token

    def _release(self, req: Request, final: bool) -> bool:
        """Emit held text up to any stop string. True when a stop string ended the request."""
        text = req.held
        if req.stop:
            hits = [(text.find(s), s) for s in req.stop if s in text]
            if hits:
                at, s = min(hits)
                req.held = ""
                if at:
                    req.emit(Delta(text[:at], []))
                self._finish(req, FinishReason.STOP, stop=s)
                return True
            if not final:
                keep = max((_overlap(text, s) for s in req.stop), default=0)
                req.held, text = text[len(text) - keep :], text[: len(text) - keep]
            else:
                req.held = ""
        else:
            req.held = ""
        if text or not final:
            req.emit(Delta(text, [] if final else [req.output_ids[-1]]))
        return False

    def _finish(self, req: Request, reason: FinishReason, stop: str | None = None) -> None:
        if req.finished:
            return
        if stop is None:
            req.held += req.detok.flush()
            if req.held and self._release(req, final=True):
                return  # the flushed text held a stop string; _release finished the request
        self._end(req)
        self.stats.finished(cancelled=reason is FinishReason.CANCELLED)
        req.emit(Done(reason, len(req.prompt_ids), len(req.output_ids), len(req.prompt_ids) - req.cached, stop, request_figures(req, self.loaded)))

    def _fail(self, req: Request, message: str) -> None:
        if req.finished:
            return
        req.session.reset()  # its cache may be half written
        self._end(req)
        self.stats.finished(failed=True)
        req.emit(Failed(message))

    def _end(self, req: Request) -> None:
        if req.state is not RequestState.WAITING:  # admitted: it holds its session
            req.session.busy = False
        req.session.reserved = False  # a pooled slot is free for the next request
        req.state = RequestState.FINISHED
        self.scheduler.remove(req)

    def _rows_now(self) -> int:
        placement = self.loaded.placement
        if placement is None or placement.one_device:
            return self.device_rows
        return self.split_rows if HOST not in placement.places else self.host_rows

    # -- placement: changes run on the engine thread, between steps -----------------------------

    def run_job(self, work: Callable[[], T], session: Session | None = None) -> Future[T]:
        """Run `work` on the engine thread between steps, once `session` (if given) has no generation running.
        The future holds its result or its exception."""
        future: Future[T] = Future()
        self._inbox.put(("job", _Job(work, session, future)))  # type: ignore[arg-type]
        return future

    def _run_jobs(self) -> None:
        for job in list(self._jobs):
            if job.session is not None and job.session.busy:
                continue  # its generation goes on; the job runs after it
            self._jobs.remove(job)
            if not job.future.set_running_or_notify_cancel():
                continue
            try:
                job.future.set_result(job.work())
            except Exception as exc:  # handed to the caller
                job.future.set_exception(exc)

    def _kvs(self) -> list[SessionKV]:
        """Every KV cache of this model: named sessions, pooled slots, and the sessions of queued or running requests."""
        seen: dict[int, SessionKV] = {}
        sessions = [*self.sessions.list(), *self.slots, *(r.session for r in [*self.scheduler.running, *self.scheduler.waiting])]
        for s in sessions:
            seen[id(s.kv)] = s.kv
        return list(seen.values())

    def _placed(self) -> None:
        """After blocks moved: the rows a step may hold, the joint-step timings and the bytes a step reads."""
        self.scheduler.max_batch = self._rows_now()
        self.joint.timings.clear()  # conditions changed: auto measures again
        self._weight_bytes = decode_bytes(self.loaded)

    def _placement(self):
        if self.loaded.placement is None:
            raise ValueError(f"model {self.loaded.name} is an embedding model: it runs whole on its device, with no placement to change")
        return self.loaded.placement

    def relocate(self, first: int, last: int, to: str, session: Session | None = None) -> Future[None]:
        """Move blocks first..last (0 is embed) to `to` (host or one of the model's devices), with every session's KV."""

        def work() -> None:
            self._placement().move(first, last, to, self._kvs())
            self._placed()

        return self.run_job(work, session)

    def replace(self, devices: list[str], gpu_layers: int = -1, session: Session | None = None) -> Future[None]:
        """Re-place every block over `devices` (none: all home to the host), at most `gpu_layers` on them (-1: all that fit)."""

        def work() -> None:
            placement = self._placement()
            places = placement.plan(devices, gpu_layers, self._spendable)
            placement.apply(places, self._kvs())
            self._placed()

        return self.run_job(work, session)

    def set_page_budget(self, budget: int) -> Future[None]:
        """Change the host page budget: blocks are read in or dropped to fit it."""

        def work() -> None:
            self._placement().pager.set_budget(budget)

        return self.run_job(work)

    def tune_seam(self, session: Session | None = None) -> Future[list[SeamCandidate]]:
        """Time decode for candidate device-block counts that fit and keep the fastest. -> what each count measured."""

        def work() -> list[SeamCandidate]:
            measured = tune_seam(self.loaded.model, self._placement(), self._kvs(), self._spendable)
            self._placed()
            return measured

        return self.run_job(work, session)

    def _spendable(self, device: str) -> int:
        return spendable_bytes(device, self._placement().pager.unspent_bytes())


@dataclass(frozen=True)
class _Job:
    work: Callable[[], Any]
    session: Session | None
    future: Future


@dataclass(frozen=True)
class _EmbedJob:
    batch: list[list[int]]
    emit: Callable[[Event], None]
    t_arrival: float
    depth: int


def _overlap(text: str, stop: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `stop`."""
    for k in range(min(len(text), len(stop) - 1), 0, -1):
        if text.endswith(stop[:k]):
            return k
    return 0
