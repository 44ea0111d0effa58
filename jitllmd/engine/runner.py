"""The model runner: packs a step's rows into one token batch, runs the forward over the placed blocks (the hidden
state crossing each seam), and times joint steps against the rows one after another.

Joint steps (JointSteps): whether a step runs its rows as one packed forward or one after another, per row count.

`auto` times the joint step for each row count it meets (decode-only steps, a few of each) against the rows one after
another, reckoned from a row's forward alone (learned once), and runs the rows one after another only where that is
clearly faster: a joint step reads the weights once for every row, so it wins
wherever a step is bound by its weights, and a noisy second on a shared machine must not turn a server's batching off
for good. `always` and `never` force it. One row is always a single forward.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from .cluster.remote import RemoteRun
from .kv import PAGE, RowSpan, SessionKV
from .layers.quant import chunk_tokens, take_rows
from .memory.placement import Placement
from .pages import pages_for
from .request import RequestState
from .scheduler import Row

__all__ = ["Batch", "JointSteps", "ModelRunner", "Timing"]


SAMPLES = 5  # timed steps of each kind per row count before auto decides (medians: one descheduled step moves nothing)
SEQUENTIAL_WINS = 0.75  # the rows one after another are chosen only at this fraction of the joint step's median time or less


@dataclass
class Timing:
    """What auto measured for one row count (ms per step), and what it chose."""

    joint_ms: list[float] = field(default_factory=list)
    sequential_ms: list[float] = field(default_factory=list)  # steps run one after another (while a row's time is learned)
    choice: str = ""  # "joint" or "sequential" once decided

    def joint_median(self) -> float:
        return statistics.median(self.joint_ms) if self.joint_ms else 0.0


class JointSteps:
    """Per row count, whether a step runs its rows jointly: forced (`always`, `never`) or timed (`auto`, above).

    The rows one after another cost about a row's forward alone times the rows, so auto learns that one figure (a
    one-row step's time, or a sequential step's over its rows) once, from SAMPLES steps, and then decides each row count
    from its joint steps alone: a new row count costs no sequential steps (16 rows one after another cost ~4 joint
    steps of 16 on the CPU, and a server meets every count from 2 to its width)."""

    def __init__(self, mode: str = "auto"):
        if mode not in ("auto", "always", "never"):
            raise ValueError(f"joint_steps must be auto, always or never, got {mode!r}")
        self.mode = mode
        self.timings: dict[int, Timing] = {}
        self.row_ms: list[float] = []  # a row's forward alone (ms): one-row decode steps, sequential steps over their rows

    def joint(self, num_rows: int, decode_only: bool) -> bool:
        """Run this step's rows jointly? While auto has too few rows' times, undecided row counts alternate."""
        if num_rows <= 1 or self.mode == "always":
            return True
        if self.mode == "never":
            return False
        t = self.timings.get(num_rows)
        if t is not None and t.choice:
            return t.choice == "joint"
        if not decode_only:
            return True  # prompt chunks make a step's time incomparable; measure on plain decode steps
        t = self.timings.setdefault(num_rows, Timing())
        return len(self.row_ms) >= SAMPLES or len(t.joint_ms) <= len(t.sequential_ms)

    def record(self, num_rows: int, joint: bool, seconds: float, decode_only: bool) -> None:
        """A step's wall time. auto decides a row count once it has SAMPLES of its joint steps and SAMPLES rows' times:
        joint unless the rows one after another (the rows times a row's median) take at most SEQUENTIAL_WINS of the
        joint step's median."""
        if self.mode != "auto" or not decode_only:
            return
        if num_rows <= 1:
            self.row_ms = [*self.row_ms[-(4 * SAMPLES - 1) :], seconds * 1000]  # the latest: a row's cost moves with its depth
            return
        t = self.timings.setdefault(num_rows, Timing())
        if t.choice:
            return
        if joint:
            t.joint_ms.append(seconds * 1000)
        else:
            t.sequential_ms.append(seconds * 1000)
            self.row_ms = [*self.row_ms[-(4 * SAMPLES - 1) :], seconds * 1000 / num_rows]
        if len(t.joint_ms) >= SAMPLES and len(self.row_ms) >= SAMPLES:
            t.choice = "sequential" if self.sequential_ms(num_rows) <= SEQUENTIAL_WINS * t.joint_median() else "joint"

    def sequential_ms(self, num_rows: int) -> float:
        """The rows one after another, as auto reckons them: the rows times a row's median (0 before any)."""
        return num_rows * statistics.median(self.row_ms) if self.row_ms else 0.0

    def choices(self) -> dict[int, tuple[str, float, float]]:
        """Row count -> (choice or "measuring", joint ms, sequential ms reckoned)."""
        return {n: (t.choice or "measuring", t.joint_median(), self.sequential_ms(n)) for n, t in sorted(self.timings.items())}


@dataclass
class Batch:
    """A step's rows packed: token ids and positions [T], one span per row, and the tokens whose logits are sampled."""

    tokens: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    spans: list[RowSpan] = field(default_factory=list)
    logits_at: list[int] = field(default_factory=list)
    num_prompt: int = 0  # prompt tokens fed (the rest are decode rows' one token each, and their guesses)
    num_drafted: int = 0  # decode rows' guesses fed (engine/speculative.py)


class ModelRunner:
    """Runs a decoder family's blocks where the placement holds them. The family builds blocks and knows its maths; it
    knows nothing of where a block lives. Only the engine thread calls it."""

    def __init__(self, model: Any, placement: Placement, short_feed: int = 0, rows_feed: int = 0, sessions: int = 1, max_seq: int = PAGE,
                 kv_mem: int | None = None):
        self.model = model
        self.placement = placement
        # the sessions' K/V pages: to start with, -sessions sessions of max_seq positions (a window's group fewer)
        windows = dict.fromkeys(model.cfg.window(i) for i in range(model.cfg.num_layers))
        pages = [sessions * pages_for(w, max_seq) for w in windows]
        self.kv_pool = placement.kv_pool = model.kv_pool(placement.kv_devices(), pages, kv_mem)
        self.short_feed = short_feed  # a prompt feeding at most this many new tokens runs as decode rows (layers/quant.py; Scheduler.feed)
        self.rows_feed = rows_feed  # ... through the few-row kernel up to this many, a prompt chunk's products past it
        self.seconds = 0.0  # the last step's wall time (run)

    @property
    def device(self) -> torch.device:
        """Where a forward's inputs go: the token embedding's place."""
        return self.placement.device_of(0)

    def new_kv(self, capacity: int) -> SessionKV:
        """A session's KV: page tables into the model's pool, each layer's pages on its block's place."""
        return SessionKV(self.kv_pool, capacity)

    # -- one forward ----------------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, rows: list[RowSpan], logits_at: torch.Tensor | None = None) -> torch.Tensor:
        """Run a packed batch. token_ids, positions: [T]; rows cover [0, T) in order.

        Each row's K/V are written at its session position, which then advances by the row's tokens. Returns f32
        logits [len(logits_at), V] (every token when logits_at is None).
        """
        for row in rows:
            row.kv.reserve(row.kv.length + row.num_tokens)
            row.begin()
        state = self.model.begin(positions)  # what every block of this forward reads (e.g. RoPE tables)
        num_layers = self.model.cfg.num_layers
        stack = self._stack(rows)
        walk = self.placement.walk(layers=stack is None)
        try:
            embed, dev = next(walk)
            x = embed(token_ids.to(dev))  # [T, hidden]
            # The last block computes only the tokens whose logits are asked for (a prompt's last), as llama.cpp does.
            at = logits_at.tolist() if logits_at is not None else None
            keep = at if at is not None and len(at) < x.shape[0] and at == sorted(set(at)) else None
            layer = 0
            if stack is not None:  # every layer in one call: a step returns to Python once, not once a layer
                t0 = time.perf_counter()
                x = stack(x, state, keep)
                self.placement.ran_layers(time.perf_counter() - t0)
                layer = num_layers
            while layer < num_layers:
                block, dev = next(walk)
                if isinstance(block, RemoteRun):  # layers on another rank: the whole batch crosses to it and back as one tensor
                    x = block(x, positions, rows, keep if block.last == num_layers - 1 else None)
                    layer = block.last + 1
                    continue
                x = block(x.to(dev), state, rows, keep if layer == num_layers - 1 else None)  # over a seam, if there is one
                layer += 1
            for row in rows:
                row.kv.length += row.num_tokens
            chunk = chunk_tokens(rows, token_ids.shape[0], many=False)  # a prompt chunk's tokens: the quantized head's prompt path
            if at is not None and at != list(range(token_ids.shape[0])):  # the logits' tokens (all, in order: as they are)
                x = x if keep is not None else take_rows(x, at)  # the last block kept only these
                chunk = None if chunk is None else take_rows(chunk, at)
            head, dev = next(walk)
            return head(x.to(dev), chunk=chunk)
        finally:
            walk.close()

    def _stack(self, rows: list[RowSpan]) -> Any:
        """The step's layers as one call (the family's `stack`), where every layer is held on this CPU and fuses these
        rows; else None (block by block)."""
        stack = getattr(self.model, "stack", None)
        if stack is None:
            return None
        blocks = self.placement.local_layers()
        return stack(blocks, rows) if blocks is not None else None

    # -- a step of requests ---------------------------------------------------------------------

    def pack(self, rows: list[Row]) -> Batch:
        """The step's rows as one token batch: their tokens and positions, a span each, the tokens whose logits are
        taken (what each feeds was decided by the scheduler's admission: Scheduler.feed)."""
        b = Batch()
        for row in rows:
            if not row.ids:
                continue
            start = len(b.tokens)
            b.tokens.extend(row.ids)
            b.positions.extend(range(row.pos, row.pos + len(row.ids)))
            b.spans.append(RowSpan(start, len(row.ids), row.req.session.kv, prompt=row.prompt, short=row.short, many=row.many))
            b.logits_at.extend(range(len(b.tokens) - row.logits, len(b.tokens)))
            if row.req.state is RequestState.PREFILL:
                b.num_prompt += len(row.ids)
            b.num_drafted += len(row.draft)
        return b

    def run(self, b: Batch, joint: JointSteps) -> torch.Tensor:
        """The batch as one packed forward or its rows one after another, as `joint` says; the step timed for it."""
        decode_only = b.num_prompt == 0 and b.num_drafted == 0  # a step of one token a row: comparable across steps
        together = joint.joint(len(b.spans), decode_only)
        self.placement.synchronize()  # the clock times this step's work alone, not its queueing
        self.placement.costs.begin_step()
        t0 = time.perf_counter()
        logits = self._forward(b.tokens, b.positions, b.spans, b.logits_at) if together else self._forward_each(b)
        self.placement.synchronize()
        seconds = self.seconds = time.perf_counter() - t0
        joint.record(len(b.spans), together, seconds, decode_only)
        self.placement.costs.end_step(seconds, self.placement.device_weight_bytes())
        return logits

    def _forward(self, tokens: list[int], positions: list[int], spans: list[RowSpan], logits_at: list[int]) -> torch.Tensor:
        """Every row in one packed forward: dense layers once over all tokens, attention per row."""
        dev = self.device
        return self.forward(
            torch.tensor(tokens, dtype=torch.long, device=dev),
            torch.tensor(positions, dtype=torch.long, device=dev),
            spans,
            torch.tensor(logits_at, dtype=torch.long, device=dev),
        )

    def _forward_each(self, b: Batch) -> torch.Tensor:
        """The rows one after another, each its own forward; logits in the same order as the joint step's."""
        out = []
        for span in b.spans:
            end = span.start + span.num_tokens
            at = [i - span.start for i in b.logits_at if span.start <= i < end]
            out.append(self._forward(b.tokens[span.start : end], b.positions[span.start : end], [RowSpan(0, span.num_tokens, span.kv, span.prompt, span.short, span.many)], at))
        return torch.cat(out) if out else torch.empty(0)
