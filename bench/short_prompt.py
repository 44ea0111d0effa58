"""Where a short prompt's tokens stop gaining from the few-row integer kernel: per quantization format and kernel
variant, a projection's time for T tokens through the decode rows' integer kernel (quant_rows) against a prompt
chunk's product (bf16 where the variant has bf16 units, else the int8 GEMM), interleaved.

    python bench/short_prompt.py                       # every variant this CPU runs, every format
    python bench/short_prompt.py --variants avx2+fma --formats Q4_K,Q6_K --rounds 7
    python bench/short_prompt.py --followup            # a follow-up turn's prefill in decode steps, on SmolLM2 and Qwen

The last column is the largest T at which the few-row kernel is still no slower: layers/formats.py's QFormat.short
holds these figures, per variant and format (a short feed of more new tokens takes the chunk's product in the
layer's fused call). --followup times a follow-up turn's prefill three ways, turn by turn: a short feed as it runs (the fused
layer, the few-row kernel or a chunk's product per the table), every short feed through the few-row kernel, and no short
feeds (the prompt chunks' path): layers/quant.py's FUSED_FEED is where the first stops beating the last.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import jitllmd  # noqa: E402,F401  (first: it sets torch's OpenMP spin before torch loads, as the CLI does)
import torch  # noqa: E402

from jitllmd.engine import kernels  # noqa: E402
from jitllmd.engine.kernels.ops import bf16_units  # noqa: E402
from jitllmd.engine.layers.formats import FORMATS  # noqa: E402
from jitllmd.engine.kernels.ops import bf16_runs, gemm_runs, quant_runs  # noqa: E402
from jitllmd.engine.request import Generation  # noqa: E402

TOKENS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96)
FEEDS = (4, 8, 16, 32, 64, 96)
COLD = 96 << 20  # bytes of weights a projection table's pass reads: past the caches
# byte offsets of each format's f16 scale fields within a block: set to small values so random codes make sane weights
_SCALES = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def weight(fmt: str, n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """n rows of random blocks of `fmt` with f16 scales of ~0.01: [n, row bytes] uint8."""
    f = FORMATS[fmt]
    blocks = torch.randint(0, 256, (n * k // f.block, f.nbytes), dtype=torch.uint8, generator=gen)
    scale = torch.tensor([0.01], dtype=torch.float16).view(torch.uint8)
    for at in _SCALES[fmt]:
        blocks[:, at : at + 2] = scale
    return blocks.reshape(n, f.row_bytes(k))


def seconds(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(fmt: str, n: int, k: int, rounds: int) -> list[tuple[int, float, float]]:
    """(T, few-row ms, many-row ms) per token count, each the median of `rounds`, the two kernels interleaved: the
    many-row product a prompt chunk's, bf16 where the variant has bf16 units, else the int8 GEMM. Each time
    is a pass over copies of the weight that add up to more than a CPU's caches (COLD bytes), per copy: a model's
    projections read their weights from memory, and the two kernels meet memory differently."""
    gen = torch.Generator().manual_seed(0)
    f = FORMATS[fmt]
    copies = max(2, COLD // (n * f.row_bytes(k)))
    runs = [[(weight(fmt, n, k, gen), f.ggml, n)] for _ in range(copies)]
    many = bf16_runs if bf16_units() is not None else gemm_runs
    out = []
    for T in TOKENS:
        x = torch.randn(T, k, generator=gen)
        a, b = [], []
        for _ in range(rounds):
            a.append(seconds(lambda: [quant_runs(x, r, n) for r in runs], 1) / copies)
            b.append(seconds(lambda: [many(x, r, n) for r in runs], 1) / copies)
        out.append((T, 1000 * statistics.median(a), 1000 * statistics.median(b)))
    return out


def followup(variant: str | None, rounds: int) -> None:
    """A session's follow-up turns of FEEDS new tokens on the real models (host blocks, as `serve` runs them by
    default): prefill_ms over the decode step, three ways interleaved turn by turn: `fused` (each layer's fused call,
    the few-row kernel up to rows_feed and a chunk's product past it, whatever the feed's size), `rows` (the fused call, the
    few-row kernel always: how short feeds ran before) and `exact` (no short feeds: the prompt
    chunks' path). The loaded model runs `fused` up to its short_feed, `exact` past it: the last column."""
    from bench.vs_llamacpp import qwen_q4_k_m, smollm2_q4_1
    from jitllmd.embedded import cache_dir
    from jitllmd.engine.engine import Engine
    from jitllmd.engine.loader import cached_conversion
    from jitllmd.engine.sampler import SamplingParams
    from tests.test_engine import collect

    greedy = SamplingParams(temperature=0.0)
    print(f"\n## follow-up turns, {kernels.describe()}\n")
    print("| model | new tokens | short_feed, rows_feed | decode step ms | fused / step | rows / step | exact / step | as loaded / step |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, gguf in (("SmolLM2-135M Q4_1", smollm2_q4_1), ("Qwen2.5-Coder-0.5B Q4_K_M", qwen_q4_k_m)):
        try:
            jlm = cached_conversion(gguf(), cache_dir())
        except RuntimeError as exc:
            print(f"| {name} | skipped: {exc} |")
            continue
        engine = Engine.load(jlm, max_batch=1, max_seq=4096)
        runner = engine.loaded.runner
        table = (runner.short_feed, runner.rows_feed)
        modes = {"fused": (10**6, table[1]), "rows": (10**6, 10**6), "exact": (0, 0)}
        text = "The history of the city of Paris begins in antiquity, on an island in the river Seine. " * 6
        try:
            for new in FEEDS:
                session = engine.new_session()  # a first turn of ~120 tokens; each follow-up then adds its own and 8 more
                collect(engine.generate(Generation(engine.loaded.tokenizer.encode(text), greedy, max_tokens=4, ignore_eos=True, session=session)))
                times: dict[str, list[float]] = {m: [] for m in modes}
                steps: list[float] = []
                for turn in range(len(modes) * rounds):
                    mode = list(modes)[turn % len(modes)]
                    runner.short_feed, runner.rows_feed = modes[mode]
                    ids = [(97 + 13 * turn + j) % 5000 + 100 for j in range(new)]  # after the history the session holds
                    r = collect(engine.generate(Generation(session.token_ids + ids, greedy, max_tokens=9, ignore_eos=True, session=session)))
                    assert r.done.fed_tokens == new, r.done.fed_tokens
                    times[mode].append(r.done.figures.prefill_ms)
                    steps.append(r.done.figures.decode_ms / 8)
                step = statistics.median(steps)
                per = {m: statistics.median(v) / step for m, v in times.items()}
                loaded = per["fused"] if new <= table[0] else per["exact"]
                print(f"| {name} | {new} | {table[0]}, {table[1]} | {step:.1f} | {per['fused']:.2f} | {per['rows']:.2f} | {per['exact']:.2f} | {loaded:.2f} |")
        finally:
            runner.short_feed, runner.rows_feed = table
            engine.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default=None, help="comma-separated kernel variants (default: every one this CPU runs)")
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--rows", type=int, default=3072, help="the projection's outputs (SmolLM2's gate and up: 3072)")
    ap.add_argument("--inputs", type=int, default=1024, help="its inputs (a multiple of 256)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--followup", action="store_true", help="the follow-up turns on the real models instead of the projection table")
    args = ap.parse_args()
    torch.set_num_threads(2)
    kernels.configure(Path.home() / ".cache" / "jitllmd" / "kernels")
    chosen = args.variants.split(",") if args.variants else kernels.variants()
    print(f"CPU kernel variants: {', '.join(kernels.variants())}; projection [{args.rows}, {args.inputs}], {torch.get_num_threads()} threads, "
          f"medians of {args.rounds}")
    if args.followup:
        for variant in chosen:
            kernels.use_variant(variant)
            followup(variant, args.rounds)
        return
    summary: dict[str, dict[str, int]] = {}
    for variant in chosen:
        kernels.use_variant(variant)
        print(f"\n## {kernels.describe()}, bf16 units: {bf16_units()}\n")
        print("| format | " + " | ".join(f"T={t}" for t in TOKENS) + " | few-row no slower up to T |")
        print("|---|" + "---:|" * (len(TOKENS) + 1))
        for fmt in args.formats.split(","):
            rows = measure(fmt, args.rows, args.inputs, args.rounds)
            wins = [t for t, a, b in rows if a <= b]
            # the crossover: the last T before the many-row product starts to win for good
            limit = 0
            for t, a, b in rows:
                if a > b:
                    break
                limit = t
            summary.setdefault(variant, {})[fmt] = limit
            cells = " | ".join(f"{a:.2f}/{b:.2f}" for _, a, b in rows)
            print(f"| {fmt} | {cells} | {limit} |" + ("" if wins == [t for t in TOKENS if t <= limit] else " (not monotone)"))
        print("\n(cells: few-row ms / many-row ms)")
    kernels.use_variant(None)
    print("\nper variant, the crossover of each format (QFormat.short in layers/formats.py) = {")
    for variant, limits in summary.items():
        print(f"    {variant!r}: {limits!r},")
    print("}")


if __name__ == "__main__":
    main()
