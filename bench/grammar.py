"""Structured output on Qwen2.5's 151,936-id vocabulary, on this CPU: the engine's constrained decode speed against
unconstrained (bench/grammar_libs.py compares the grammar libraries, llguidance and xgrammar).

    python bench/grammar.py                             # 3 interleaved rounds, 64 tokens a row, medians
    python bench/grammar.py --rounds 7 --tokens 48 --rows 4
    python bench/grammar.py --model path/to/model.jlm

Issue 20's target: a constrained row decodes at >= 0.9x an unconstrained one; the other rows of its batch unaffected
within noise. Loads Qwen2.5-Coder-0.5B-Instruct Q4_K_M on the cpu device (so it batches), and times per row decode
tok/s (the Done figures: tokens after the first over the time from the first to the last, prefill excluded) of
greedy replies, every row `--tokens` long (the unconstrained ones ignore end of sequence; the schema's shortest
instance is longer than that, so the constrained one ends by length too): (a) one row unconstrained against one row
constrained by a JSON schema; (b) `--rows` rows all unconstrained against the same with one of them constrained. The
variants are interleaved, round by round. Constraint.mask and .accept are wrapped to time them on the engine thread
as it runs; the constrained reply is then replayed through fresh matchers on the engine thread, timing mask's parts
(llguidance's fill, the 0/-inf table lookup, the add) beside the former masked_fill apply and a numpy one.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.grammar_libs import pct, qwen_gguf  # noqa: E402

# an object with one array of short strings: its shortest instance (40 items of 3+ characters) outruns --tokens, so a
# constrained reply ends by length as an unconstrained one does
LONG_LIST = {
    "type": "object",
    "properties": {"fruits": {"type": "array", "items": {"type": "string", "minLength": 3, "maxLength": 16}, "minItems": 40, "maxItems": 60}},
    "required": ["fruits"],
    "additionalProperties": False,
}


def qwen_jlm() -> Path:
    """Qwen2.5-Coder-0.5B-Instruct Q4_K_M's .jlm as the tests convert it (tests/conftest.py's qwen_jlm), made once."""
    from jitllmd.embedded import cache_dir
    from jitllmd.engine.loader import cached_conversion

    return cached_conversion(qwen_gguf("--model"), cache_dir() / "test")


class Timed:
    """Constraint.mask and Constraint.accept wrapped in the bench process: each call's seconds, per label; and, inside
    mask, llguidance's fill alone (the matcher behind a proxy that times it): the rest of mask is its torch apply."""

    def __init__(self):
        from jitllmd.engine.grammar import Constraint

        self.label = ""
        self.calls: dict[tuple[str, str], list[float]] = {}
        for name in ("mask", "accept"):
            setattr(Constraint, name, self._wrap(name, getattr(Constraint, name)))

    def _wrap(self, name: str, method):
        def timed(constraint, *args):
            if not isinstance(constraint.matcher, TimedMatcher):
                constraint.matcher = TimedMatcher(constraint.matcher, self)
            t0 = time.perf_counter()
            out = method(constraint, *args)
            self.calls.setdefault((self.label, name), []).append(time.perf_counter() - t0)
            return out

        return timed

    def median_us(self, label: str, name: str) -> float:
        xs = self.calls.get((label, name))
        return statistics.median(xs) * 1e6 if xs else float("nan")


class TimedMatcher:
    """An llguidance matcher whose mask fill is timed into `timed` ("fill"); everything else passes through."""

    def __init__(self, matcher, timed: Timed):
        self._matcher, self._timed = matcher, timed

    def unsafe_compute_mask_ptr(self, *args):
        t0 = time.perf_counter()
        out = self._matcher.unsafe_compute_mask_ptr(*args)
        self._timed.calls.setdefault((self._timed.label, "fill"), []).append(time.perf_counter() - t0)
        return out

    def __getattr__(self, name: str):
        return getattr(self._matcher, name)


def replay(fresh, token_ids: list[int], vocab_rows: int) -> dict[str, list[float]]:
    """Constraint.mask's parts, timed token by token through a reply already sampled (run on the engine thread):
    llguidance's fill, each mask byte to 8 floats of 0 or -inf (the table lookup), their add to the logits (a copy);
    then accept; and, for comparison, the former apply (bits to booleans, inverted, a masked_fill copy) and the lookup
    and add in numpy (one thread: no OpenMP region). Then mask whole, on a second pass with a `fresh()` constraint (the
    matcher keeps the mask of its state: a second fill there costs next to nothing)."""
    import numpy as np
    import torch

    from jitllmd.engine.grammar import _ADD

    allowed_of_byte = _ADD == 0  # [256, 8] bool: the former apply's table
    add_np = _ADD.numpy()
    logits = torch.randn(vocab_rows)  # [V] f32, as a row of the step's logits
    num = logits.shape[-1]
    constraint = fresh()
    matcher = constraint.matcher  # itself: Timed puts a proxy in front of it at a first mask
    bitmask = torch.zeros_like(constraint._mask)
    m = bitmask.numpy()
    parts: dict[str, list[float]] = {k: [] for k in ("fill", "lookup", "add", "accept", "masked_fill", "numpy", "mask")}
    for token in token_ids:
        t0 = time.perf_counter()
        matcher.unsafe_compute_mask_ptr(m.ctypes.data, m.nbytes)
        t1 = time.perf_counter()
        add = _ADD.index_select(0, bitmask.view(torch.uint8).int()).view(-1)[:num]
        t2 = time.perf_counter()
        added = logits + add.to(logits.device)
        t3 = time.perf_counter()
        constraint.accept(token)
        t4 = time.perf_counter()
        masked = logits.masked_fill(~allowed_of_byte.index_select(0, bitmask.view(torch.uint8).int()).view(-1)[:num], float("-inf"))
        t5 = time.perf_counter()
        picked = logits.numpy() + np.take(add_np, m.view(np.uint8), axis=0).reshape(-1)[:num]
        t6 = time.perf_counter()
        assert torch.equal(added, masked) and np.array_equal(picked, added.numpy()), "an apply differs"
        for k, dt in zip(parts, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t6 - t5)):
            parts[k].append(dt)
    constraint = fresh()
    for token in token_ids:
        t0 = time.perf_counter()
        constraint.mask(logits)
        parts["mask"].append(time.perf_counter() - t0)
        constraint.accept(token)
    return parts


def run_decode(a: argparse.Namespace) -> None:
    import torch

    from jitllmd.engine import kernels
    from jitllmd.engine.engine import Engine
    from jitllmd.engine.grammar import GrammarSpec
    from jitllmd.engine.request import Done, Failed
    from jitllmd.engine.sampler import SamplingParams

    path = Path(a.model).expanduser() if a.model else qwen_jlm()
    rows = a.rows
    timed = Timed()
    engine = Engine.load(path, max_batch=rows, row_limit=rows, devices=["cpu"], sessions=rows, max_seq=1024)
    loaded = engine.loaded
    figures0 = {}
    kernel = kernels.describe()
    spec = GrammarSpec(schema=LONG_LIST)
    greedy = SamplingParams(temperature=0)
    t0 = time.perf_counter()
    loaded.grammars.constraint(spec)  # the vocabulary side, built once (seconds)
    print(f"{path.name}: llguidance vocabulary built in {time.perf_counter() - t0:.1f} s; kernels: {kernel}", file=sys.stderr)

    def prompt(i: int) -> list[int]:
        ask = f"List {40 + i} fruit names as JSON: an object whose key \"fruits\" holds an array of their names."
        return loaded.tokenizer.encode(loaded.chat.render([{"role": "user", "content": ask}]))

    prompts = [prompt(i) for i in range(rows)]

    def generate(num: int, constrained: int, tokens: int) -> list[tuple[dict, list[int], bool]]:
        """`num` rows at once, the first `constrained` of them under LONG_LIST: each row's (figures, output ids,
        constrained), once all are done."""
        from jitllmd.engine.request import Generation

        left, lock, finished = [num], threading.Lock(), threading.Event()
        dones: dict[int, Done | Failed] = {}

        def emitter(i: int):
            def emit(ev) -> None:  # on the engine thread
                if isinstance(ev, (Done, Failed)):
                    dones[i] = ev
                    with lock:
                        left[0] -= 1
                        if not left[0]:
                            finished.set()
            return emit

        reqs = [engine.submit(Generation(prompts[i], greedy, max_tokens=tokens, ignore_eos=i >= constrained, constraint=loaded.grammars.constraint(spec) if i < constrained else None), emitter(i), hold=True) for i in range(num)]
        engine.enqueue(reqs)  # one drain: every row's prompt in the same first step
        finished.wait()
        out = []
        for i, req in enumerate(reqs):
            d = dones[i]
            if isinstance(d, Failed):
                sys.exit(f"row {i} failed: {d.message}")
            if d.finish_reason.value != "length" or d.completion_tokens != tokens:
                print(f"  warning: row {i} ended {d.finish_reason.value} after {d.completion_tokens} tokens", file=sys.stderr)
            out.append((d.figures, list(req.output_ids), i < constrained))
        figures0.update(d.figures)
        return out

    generate(rows, 1, 8)  # warm up: the batch's shapes, a constrained row's path
    generate(1, 1, 8)
    variants = [("a1", 1, 0), ("a1c", 1, 1), ("b", rows, 0), ("bc", rows, 1)]  # (label, rows, constrained rows)
    runs: dict[str, list[list[tuple[dict, list[int], bool]]]] = {}
    for r in range(a.rounds):
        for label, num, constrained in variants if r % 2 == 0 else variants[::-1]:  # interleaved: these machines drift
            timed.label = label
            runs.setdefault(label, []).append(generate(num, constrained, a.tokens))
        timed.label = ""
        tps = {k: statistics.median(f["decode_tokens_per_second"] for f, _, _ in v[-1]) for k, v in runs.items()}
        print(f"round {r + 1}: median row tok/s " + ", ".join(f"{k} {v:.1f}" for k, v in tps.items()), file=sys.stderr)
    reply = next(ids for _, ids, c in runs["a1c"][0] if c)
    print(f"the constrained reply: {loaded.tokenizer.decode(reply)[:160]!r}", file=sys.stderr)
    parts = engine.run_job(lambda: replay(lambda: loaded.grammars.constraint(spec), reply, loaded.model.cfg.vocab_size)).result()
    engine.stop()

    def row_tps(label: str, constrained: bool | None) -> list[float]:
        """Per round: the median tok/s of the label's rows that are constrained (True), not (False), or all (None)."""
        return [statistics.median(f["decode_tokens_per_second"] for f, _, c in run if constrained is None or c == constrained)
                for run in runs[label]]

    def line(case: str, num: int, measured: str, mine: list[float], base: list[float], target: str, label: str) -> str:
        ratios = [x / y for x, y in zip(mine, base)]  # per round: each pair ran side by side
        variant = kernel.split(" (")[0]
        mask, fill, accept = (timed.median_us(label, k) for k in ("mask", "fill", "accept"))
        share = (mask + accept) / 1e6 * statistics.median(mine)  # of a step: one constrained row, one mask a step
        return (f"| {case} | {num} | {measured} | {statistics.median(mine):.1f} | {statistics.median(base):.1f} | "
                f"**{statistics.median(ratios):.3f}** ({min(ratios):.3f}-{max(ratios):.3f}) | {target} | "
                f"{mask:.0f} ({fill:.0f} + {mask - fill:.0f}) | {accept:.0f} | {share:.1%} | {variant} |")

    us = 1e6
    print(f"\n{path.name} on the cpu device ({figures0.get('device_blocks')} device blocks, {figures0.get('host_blocks')} host), "
          f"-max-batch {rows}, greedy, {a.tokens} tokens a row, {torch.get_num_threads()} torch threads, median of {a.rounds} "
          f"interleaved rounds (ratio: the rounds' median, their range in brackets); kernels: {kernel}")
    print("| case | rows | row(s) measured | tok/s | tok/s all unconstrained | ratio | target | mask µs/token (fill + apply) | accept µs/token "
          "| mask+accept of a step | kernels |")
    print("|---|---:|---|---:|---:|---:|---|---:|---:|---:|---|")
    print(line("a", 1, "the constrained row", row_tps("a1c", True), row_tps("a1", None), "≥ 0.9", "a1c"))
    print(line("b", rows, "the constrained row", row_tps("bc", True), row_tps("b", None), "≥ 0.9", "bc"))
    print(line("b", rows, f"the {rows - 1} others (median)", row_tps("bc", False), row_tps("b", None), "1 within noise", "bc"))
    print(f"\nConstraint.mask's parts, replayed on the engine thread through the constrained reply's {len(reply)} tokens "
          f"(a {loaded.model.cfg.vocab_size}-float logits row):")
    print("| part | median µs | p90 µs | max µs |")
    print("|---|---:|---:|---:|")
    names = {"fill": "llguidance fill (unsafe_compute_mask_ptr)", "lookup": "bytes to 0/-inf floats (_ADD.index_select)",
             "add": "logits + the 0/-inf row, a copy", "mask": "Constraint.mask, whole (a 2nd pass)",
             "accept": "Constraint.accept (consume_token)",
             "masked_fill": "for comparison: the former apply (bits to booleans, ~, masked_fill)",
             "numpy": "for comparison: the lookup and add in numpy (np.take)"}
    for k, label in names.items():
        xs = parts[k]
        print(f"| {label} | {statistics.median(xs) * us:.0f} | {pct(xs, 0.9) * us:.0f} | {max(xs) * us:.0f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (medians)")
    ap.add_argument("--model", help="the .jlm (default: Qwen2.5-Coder-0.5B-Instruct Q4_K_M, as the tests convert it)")
    ap.add_argument("--rows", type=int, default=8, help="the batch of case (b)")
    ap.add_argument("--tokens", type=int, default=64, help="tokens a row (at most 80: LONG_LIST's shortest instance)")
    a = ap.parse_args()
    if a.rows < 2 or not 2 <= a.tokens <= 80:
        ap.error("--rows must be >= 2 and --tokens between 2 and 80")
    import jitllmd  # noqa: F401  (before torch, as the CLI runs it: it tunes torch's OpenMP threads' spin as torch loads)

    run_decode(a)


if __name__ == "__main__":
    main()
