"""The step loop of one model on its own thread: pick rows -> run the model -> sample and hand out events."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import TypeVar

import torch

from . import session_file
from .cluster.link import RankError
from .draft import Drafter, draft_model_for, draft_of, speculator_for
from .figures import Figures
from .inbox import Cancel, CancelAll, EmbedJob, Job, Message, Submit, Wake
from .kv import RoomError, SessionKV
from .kv_budget import KVBudget
from .kv_spill import spill_for
from .loader import LoadedModel, load_model
from .memory.devices import trim_heap
from .memory.jobs import PlacementJobs
from .memory.placement import HOST, Placement, Room
from .outputs import Outputs
from .request import Done, Embedded, Event, Failed, FinishReason, Generation, Request, RequestState
from .runner import JointSteps
from .sampler import Sampler
from .scheduler import Row, Scheduler
from .sessions import Session, SessionRegistry, SlotPool
from .speculative import SpecConfig
from .stats import EngineStats
from .tuning.batching import Batching, decide
from .tuning.seam import SeamCandidate

__all__ = ["Engine"]

log = logging.getLogger("jitllmd.engine")
T = TypeVar("T")
_TRIM_EVERY_S = 5.0  # at most this often, an engine that falls idle hands the heap's free pages back to the OS


class Engine:
    """Runs one loaded model. Thread-safe `submit`/`cancel`; events reach each request's `emit` from the engine thread."""

    def __init__(
        self, loaded: LoadedModel, *, max_batch: int = 1, prompt_chunk: int = 512, joint_steps: str = "auto",
        host_rows: int | None = None, split_rows: int | None = None, room: Room | None = None, spec: SpecConfig | None = None,
        drafter: Drafter | None = None, prefix_cache: bool = True,
    ):
        self.loaded = loaded
        self.device_rows = max_batch  # rows of a step while every block is on one device
        self.host_rows = max_batch if host_rows is None else host_rows  # requests at once while any block is on the host
        self.split_rows = self.host_rows if split_rows is None else split_rows  # ... while split over devices, none on the host
        self.batching: Batching | None = None  # what load decided for the step's rows and prompt chunk, and why
        self.scheduler = Scheduler(self._rows_now(), prompt_chunk)
        self.scheduler.prefix_cache = prefix_cache and loaded.runner is not None  # a decoder's prompts start from cached pages
        self.joint = JointSteps(joint_steps)
        self.sessions = SessionRegistry()
        self.stats = EngineStats()
        self.outputs = Outputs(loaded, self.scheduler, self.stats)
        self.speculator = speculator_for(spec, drafter, loaded)
        self.kv_spill = spill_for(loaded, lambda: (self.sessions.list(), self.slots))  # idle sessions' pages may leave the pool
        budget = self.kv_budget = KVBudget(loaded.runner.kv_pool, self.speculator) if loaded.runner is not None and loaded.runner.kv_pool.limit else None
        if budget is not None:  # -kv-mem: a request waits until the pages it may need fit
            self.scheduler.fits = lambda req, running: budget.fits(req, running, self.slots, self.outputs.refuse, self.kv_spill)
        self.outputs.speculator = self.speculator
        self._inbox: queue.SimpleQueue[Message] = queue.SimpleQueue()
        self.pool = SlotPool(loaded.name, loaded.new_kv)  # ephemeral sessions kept for prefix reuse, one per row
        self._weight_bytes = loaded.decode_bytes()
        self._jobs: list[Job] = []  # placement changes waiting for their session's generation to end
        self.after_step: Callable[[], None] | None = None  # runs between steps of this busy model (Catalog's: relocation)
        self.last_active = time.monotonic()  # when a step last ran rows of this model
        self._trimmed = 0.0  # when the heap was last trimmed
        self.moves = PlacementJobs(loaded, self._kvs, self._placed, room)
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._owns_model = False  # loaded by Engine.load: stop() lets go of its weights

    # -- public API -----------------------------------------------------------------------------

    @classmethod
    def load(
        cls, path, *, max_batch: int = 1, prompt_chunk: int = 512, joint_steps: str = "auto", row_limit: int = 1,
        host_rows: int | None = None, split_rows: int | None = None, spec: SpecConfig | None = None, prefix_cache: bool = True, **load_kw,
    ) -> Engine:
        """Load a model on a new engine thread and run its step loop there.

        Torch's CPU thread pool belongs to the thread that first uses it: loading on one thread and stepping
        on another leaves two pools fighting over the cores (measured: decode 2x slower on 2 cores).
        load_kw go to `load_model` (name, devices, gpu_layers, sessions, max_seq, page_budget, on_progress); its
        errors raise here. A model wholly on one device batches up to max_batch rows, 0 for `row_limit` (-sessions: the
        widest step); prompt_chunk 0 is one prefill chunk of the device (engine/tuning/batching.py), decided from counts. A
        model with host blocks runs `host_rows` requests at once (default max_batch); one split over several devices
        with none on the host, `split_rows` (-device-concurrency; default host_rows). `prefix_cache`: prompts start
        from the pages another request left with the same tokens (engine/pages.py).
        """
        box: dict = {}
        ready = threading.Event()

        def main() -> None:
            try:
                loaded = load_model(path, **load_kw)
                kind = loaded.runner.device.type if loaded.runner is not None else "cpu"
                batching = decide(max_batch=max_batch, sessions=max(1, row_limit), prompt_chunk=prompt_chunk, device_kind=kind, max_seq=loaded.max_seq)
                try:
                    drafter = draft_model_for(spec, loaded, load_kw)
                    engine = cls(loaded, max_batch=batching.max_rows, prompt_chunk=batching.prompt_chunk, joint_steps=joint_steps, host_rows=host_rows,
                                 split_rows=split_rows, room=load_kw.get("room"), spec=spec, drafter=drafter, prefix_cache=prefix_cache)
                except BaseException:
                    loaded.close()
                    raise
                engine.batching = batching
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

    def stop(self, timeout: float | None = None) -> None:
        """Cancel everything and end the thread. With a timeout, a thread still inside a step after it is left to
        itself (a process on its way out): it keeps the model's weights, which it may be reading."""
        self._stopping = True
        self._inbox.put(Wake())
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("%s: the engine is still inside a step after %gs; leaving it", self.loaded.name, timeout)
                return
            self._thread = None
        if self._owns_model:
            self.loaded.close()
            if self.speculator is not None:
                self.speculator.close()

    def new_session(self, max_seq: int | None = None) -> Session:
        """A named session that keeps its KV cache across requests."""
        return self.sessions.create(self.loaded.name, self.loaded.new_kv(max_seq))

    def save_session(self, session: Session) -> Future[bytes]:
        """The session as a session file's bytes (engine/session_file.py), once its generation has ended."""
        return self.run_job(lambda: session_file.dump(session, session_file.identity(self.loaded)), session)

    def restore_session(self, saved: session_file.SavedSession, sid: str | None = None) -> Future[Session]:
        """A new named session (id `sid` where free) holding a saved one of this model (ValueError where it is another
        model's, or too long for this one's context)."""
        capacity = session_file.room_for(saved, self.loaded, session_file.identity(self.loaded))

        def work() -> Session:
            session = self.sessions.create(self.loaded.name, self.loaded.new_kv(capacity), sid)
            try:
                session_file.restore_into(session, saved)
            except BaseException:
                self.sessions.close(session.id)
                raise
            return session

        return self.run_job(work)

    def submit(self, spec: Generation, emit: Callable[[Event], None], *, follows: Request | None = None, hold: bool = False) -> Request:
        """Queue a generation. Raises RoomError when the prompt does not fit the session (both numbers named), and
        ValueError for what the model cannot take. `follows`: an earlier request of the same prompt, which runs it once
        for both (n > 1): this one copies its KV and samples its own tokens from there. `hold`: build the request but
        queue it later, with others (enqueue)."""
        prompt_ids, params, session = list(spec.prompt_ids), spec.params, spec.session
        if self.loaded.embeds:
            raise ValueError(f"model {self.loaded.name} is an embedding model: it embeds text, it does not generate")
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        if spec.max_tokens is not None and spec.max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {spec.max_tokens}")
        vocab = self.loaded.tokenizer.vocab_size
        if any(not 0 <= t < vocab for t in prompt_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if any(t >= vocab for t, _ in params.logit_bias):
            raise ValueError(f"logit_bias: token ids must be in [0, {vocab})")
        thinking = spec.thinking
        if thinking is not None and any(not 0 <= t < vocab for t in (thinking.open_id, thinking.close_id, *thinking.after_ids)):
            raise ValueError(f"thinking: marker token ids must be in [0, {vocab})")
        if follows is not None and (session is not None or follows.prompt_ids != prompt_ids):
            raise ValueError("a request follows another only with the same prompt and no named session")
        if session is None:  # ephemeral: never registered; a pooled slot keeps its KV for the next prompt
            session = self.pool.take(prompt_ids, self.scheduler.max_batch)
        cap, n = session.max_seq, len(prompt_ids)
        if n >= cap:
            raise RoomError(f"the prompt has {n} tokens but the session has room for {cap}: no room is left to generate")
        room = cap - n
        req = Request(
            prompt_ids=prompt_ids,
            params=params,
            emit=emit,
            session=session,
            max_tokens=room if spec.max_tokens is None else min(spec.max_tokens, room),
            sampler=Sampler(params, prompt_ids, spec.constraint, spec.thinking),
            detok=self.loaded.tokenizer.detokenizer(context=prompt_ids[-8:]),
            stop=list(spec.stop),
            ignore_eos=spec.ignore_eos,
            request_id=spec.request_id,
            prompt_logprobs=spec.prompt_logprobs,
            leader=follows,
        )
        if self.speculator is not None and spec.speculative is not False:
            req.spec = self.speculator.row(spec.draft_max, forced=spec.speculative is True)
        if self.kv_budget is not None and (error := self.kv_budget.refuses(req)):
            if spec.session is None:
                session.reserved = False  # the pooled slot goes back
            raise RoomError(error)
        if not hold:
            self._inbox.put(Submit(req))
        return req

    def enqueue(self, reqs: list[Request]) -> None:
        """Queue held requests together: the engine takes them in one drain (a leader cannot run its prompt before
        its followers are linked)."""
        if reqs:
            self._inbox.put(Submit(reqs[0], tuple(reqs[1:])))

    @property
    def slots(self) -> list[Session]:
        """The pooled ephemeral sessions (their KV stays for prefix reuse)."""
        return self.pool.held()

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
        depth = len(self.scheduler.running) + len(self.scheduler.waiting) + self._inbox.qsize()  # what is ahead of it
        self._inbox.put(EmbedJob(batch, emit, time.perf_counter(), depth))

    def cancel(self, req: Request) -> None:
        self._inbox.put(Cancel(req))

    def snapshot(self) -> tuple[list[Request], list[Request]]:
        """A snapshot of the running and the waiting requests (waiting in arrival order)."""
        return list(self.scheduler.running), list(self.scheduler.waiting)

    def cancel_all(self) -> None:
        """Cancel every request, waiting or running; each ends with finish reason `cancelled`."""
        self._inbox.put(CancelAll())

    def generate(self, spec: Generation) -> Iterator[Event]:
        """Submit now (errors raise here) and iterate the events in the caller's thread.

        Leaving the iteration early (break, close, KeyboardInterrupt) cancels the request.
        """
        events: queue.SimpleQueue[Event] = queue.SimpleQueue()
        req = self.submit(spec, events.put)
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
            scheduled = self.scheduler.schedule()
            if not scheduled:
                continue
            try:
                runner = self.loaded.runner
                rows = self.scheduler.feed(scheduled, *((runner.short_feed, runner.rows_feed) if runner is not None else (0, 0)))
                if self.speculator is not None:  # guesses ride in the step's token budget, after the prompts' tokens
                    rows = self.speculator.draft(rows, self.scheduler.prompt_chunk - sum(len(r.ids) for r in rows if r.prompt))
                logits = self._run(rows)
                self.outputs.postprocess(rows, logits, self._weight_bytes)
                if self.kv_spill is not None:  # -maxmem: what the host holds between turns
                    self.kv_spill.settle([r.session for r in self.scheduler.running if not r.finished])
            except RankError as exc:  # another rank holding blocks is gone: these rows fail now, not after a hang
                log.warning("%s: step failed: %s", self.loaded.name, exc)
                for req, _ in scheduled:
                    self.outputs.fail(req, f"model {self.loaded.name} is unavailable: {exc}", unavailable=True)
            except Exception as exc:  # a bug or out of memory: fail these rows, keep serving
                log.exception("step failed")
                for req, _ in scheduled:
                    self.outputs.fail(req, f"internal error in the engine: {type(exc).__name__}")
            self.last_active = time.monotonic()
            if self.after_step is not None:
                self._after_step(self.after_step)
            if self.scheduler.idle and self.last_active - self._trimmed > _TRIM_EVERY_S:
                self._trim()
        for req in list(self.scheduler.running) + list(self.scheduler.waiting):
            self.outputs.finish(req, FinishReason.CANCELLED)
        for job in self._jobs:
            job.future.cancel()

    def _drain(self, block: bool) -> None:
        while True:
            try:
                msg = self._inbox.get(block=block)
            except queue.Empty:
                return
            block = False
            match msg:
                case Submit(first, more):
                    for req in (first, *more):
                        leader = req.leader
                        if leader is not None:  # linked here, on the engine thread: the leader may be past its prompt
                            if leader.state in (RequestState.WAITING, RequestState.PREFILL) and not leader.finished:
                                leader.followers.append(req)
                            else:
                                req.leader = None
                        self.scheduler.add(req)
                case Cancel(req) if not req.finished:
                    self._cancel(req)
                case EmbedJob():
                    self._embed(msg)
                case Job():
                    self._jobs.append(msg)
                case CancelAll():
                    for r in [*self.scheduler.running, *self.scheduler.waiting]:
                        self._cancel(r)
            if self._stopping:
                return

    def _embed(self, job: EmbedJob) -> None:
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
        figures = Figures.build(self.loaded.where(), session_id="", arrival=job.t_arrival, first_step=t0, first_token=t1, last_token=None,
                                queue_depth=job.depth, generated=0, bytes_per_token=int(self._weight_bytes / max(1, num_tokens)))
        job.emit(Embedded(vectors, num_tokens, figures))

    def _cancel(self, req: Request) -> None:
        """A waiting request ends now; a running one leaves its row at the next step."""
        req.cancel_requested = True
        if req.state is RequestState.WAITING:
            self.outputs.finish(req, FinishReason.CANCELLED)

    def _run(self, rows: list[Row]) -> torch.Tensor:
        """One step: every row's tokens packed into one batch (engine/runner.py). Returns logits of the rows that sample."""
        runner = self.loaded.runner
        assert runner is not None  # a decoder's; embedding models take no rows
        batch = runner.pack(rows)
        if not batch.spans:
            return torch.empty(0)
        self.stats.step(len(batch.spans), batch.num_prompt)
        logits = runner.run(batch, self.joint)
        if self.speculator is not None and batch.num_prompt == 0:  # what a guessed token costs a step, measured
            self.speculator.steps.observe(len(batch.tokens), runner.seconds)
        return logits

    def _after_step(self, hook: Callable[[], None]) -> None:
        """Between steps of this busy model: the server's hook (relocation may bring a host block back)."""
        try:
            hook()
        except Exception:  # out of device memory, say: the blocks stay where they are, serving goes on
            log.exception("%s: between steps", self.loaded.name)

    def _trim(self) -> None:
        """The last request ended: hand the heap pages requests freed back to the OS (glibc keeps them otherwise; a
        6-minute soak's RSS came down 33 MiB when trimmed at its end, bench/soak.py)."""
        trim_heap()
        self._trimmed = time.monotonic()

    # -- what relocation sees (memory/relocation.py's Tenant) -----------------------------------

    @property
    def name(self) -> str:
        return self.loaded.name

    @property
    def placement(self) -> Placement | None:
        return self.loaded.placement

    @property
    def rows_per_step(self) -> float:
        return self.stats.rows_per_step

    def spendable_driver(self, device: str) -> int:
        return self.moves.spendable_driver(device)

    @property
    def draft_placement(self) -> Placement | None:
        """Where its draft model's blocks are (speculative decoding's: engine/draft.py), held beside its own."""
        return draft.loaded.placement if (draft := draft_of(self.speculator)) is not None else None

    def idle_for(self, now: float) -> float | None:
        """Seconds since this model last ran a row; None while it has rows running or waiting (read from any thread)."""
        return None if self.scheduler.running or self.scheduler.waiting else max(0.0, now - self.last_active)

    def move_blocks(self, first: int, last: int, to: str) -> None:
        """On the engine thread, between steps: blocks first..last to `to`, with every session's KV."""
        self.moves.relocate(first, last, to)()

    def rows_why(self) -> str:
        """Why a step holds at most `scheduler.max_batch` rows now: the batching load decided, or the flag that limits
        a model whose blocks are not all on one device."""
        placement = self.loaded.placement
        if placement is None or placement.one_device:
            return self.batching.rows_why if self.batching is not None else f"max_batch {self.device_rows}"
        return "-device-concurrency: split over devices" if HOST not in placement.places else "-host-concurrency: blocks on the host"

    def _rows_now(self) -> int:
        placement = self.loaded.placement
        return self.device_rows if placement is None or placement.one_device else self.split_rows if HOST not in placement.places else self.host_rows

    # -- placement: changes run on the engine thread, between steps -----------------------------

    def run_job(self, work: Callable[[], T], session: Session | None = None) -> Future[T]:
        """Run `work` on the engine thread between steps, once `session` (if given) has no generation running.
        The future holds its result or its exception."""
        future: Future[T] = Future()
        self._inbox.put(Job(work, session, future))
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
        self._weight_bytes = self.loaded.decode_bytes()

    def relocate(self, first: int, last: int, to: str, session: Session | None = None) -> Future[None]:
        """Move blocks first..last (0 is embed) to `to` (host or one of the model's devices), with every session's KV."""
        return self.run_job(self.moves.relocate(first, last, to), session)

    def replace(self, devices: list[str], gpu_layers: int = -1, session: Session | None = None) -> Future[None]:
        """Re-place every block over `devices` (none: all home to the host), at most `gpu_layers` on them (-1: all that fit)."""
        return self.run_job(self.moves.replace(devices, gpu_layers), session)

    def set_page_budget(self, budget: int) -> Future[None]:
        """Change the host page budget: blocks are read in or dropped to fit it."""
        return self.run_job(self.moves.set_page_budget(budget))

    def tune_seam(self, session: Session | None = None) -> Future[list[SeamCandidate]]:
        """Time decode for candidate device-block counts that fit and keep the fastest. -> what each count measured."""
        return self.run_job(self.moves.tune_seam(), session)
