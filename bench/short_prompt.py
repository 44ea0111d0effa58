"""Where a short prompt's tokens stop gaining from the few-row integer kernel: per quantization format and kernel
variant, a projection's time for T tokens through the decode rows' integer kernel against the prompt chunks' exact
path (bf16 panels where the variant has bf16 units, else f32 panels dequantized in turn), interleaved.

    python bench/short_prompt.py                       # every variant this CPU runs, every format
    python bench/short_prompt.py --variants avx2+fma --formats Q4_K,Q6_K --rounds 7
    python bench/short_prompt.py --followup            # a follow-up turn's prefill in decode steps, on SmolLM2 and Qwen

The last column is the largest T at which the integer kernel is still no slower: layers/formats.py's QFormat.short
holds these figures, per variant and format, and a prompt feed of at most that many new tokens runs as decode rows do.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from jitllmd.engine import kernels  # noqa: E402
from jitllmd.engine.kernels.ops import bf16_units  # noqa: E402
from jitllmd.engine.layers.formats import FORMATS  # noqa: E402
from jitllmd.engine.layers.quant import QuantLinear, Segment  # noqa: E402
from jitllmd.engine.request import Generation  # noqa: E402

TOKENS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96)
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
    """(T, integer ms, exact ms) per token count, each the median of `rounds`, the two paths interleaved."""
    gen = torch.Generator().manual_seed(0)
    proj = QuantLinear(weight(fmt, n, k, gen), [Segment(FORMATS[fmt], n, k)], None)
    out = []
    for T in TOKENS:
        x = torch.randn(T, k, generator=gen)
        exact = torch.ones(T, dtype=torch.bool)
        a, b = [], []
        for _ in range(rounds):
            a.append(seconds(lambda: proj(x), 1))  # no chunk mask: the integer kernel, as decode rows
            b.append(seconds(lambda: proj(x, chunk=exact), 1))  # every token a prompt chunk's: the exact path
        out.append((T, 1000 * statistics.median(a), 1000 * statistics.median(b)))
    return out


def followup(variant: str | None, rounds: int) -> None:
    """A session's follow-up turn of 4, 8 and 16 new tokens on the real models (host blocks, as `serve` runs them by
    default): its prefill_ms against the decode step, with short feeds (the table) and with them off (short_feed 0),
    interleaved turn by turn."""
    from bench.vs_llamacpp import qwen_q4_k_m, smollm2_q4_1
    from jitllmd.embedded import cache_dir
    from jitllmd.engine.engine import Engine
    from jitllmd.engine.loader import cached_conversion
    from jitllmd.engine.sampler import SamplingParams
    from tests.test_engine import collect

    greedy = SamplingParams(temperature=0.0)
    print(f"\n## follow-up turns, {kernels.describe()}\n")
    print("| model | new tokens | short_feed | prefill ms, short | prefill ms, exact | decode step ms | short prefill / step | exact / step |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, gguf in (("SmolLM2-135M Q4_1", smollm2_q4_1), ("Qwen2.5-Coder-0.5B Q4_K_M", qwen_q4_k_m)):
        try:
            jlm = cached_conversion(gguf(), cache_dir())
        except RuntimeError as exc:
            print(f"| {name} | skipped: {exc} |")
            continue
        engine = Engine.load(jlm, max_batch=1, max_seq=4096)
        table = engine.loaded.runner.short_feed
        text = "The history of the city of Paris begins in antiquity, on an island in the river Seine. " * 6
        try:
            for new in (4, 8, 16):
                session = engine.new_session()
                collect(engine.generate(Generation(engine.loaded.tokenizer.encode(text), greedy, max_tokens=4, ignore_eos=True, session=session)))
                times: dict[str, list[float]] = {"short": [], "exact": []}
                steps: list[float] = []
                for turn in range(2 * rounds):
                    mode = "short" if turn % 2 == 0 else "exact"
                    engine.loaded.runner.short_feed = table if mode == "short" else 0
                    ids = [(97 + 13 * turn + j) % 5000 + 100 for j in range(new)]
                    r = collect(engine.generate(Generation(ids, greedy, max_tokens=9, ignore_eos=True, session=session)))
                    assert r.done.fed_tokens == new, r.done.fed_tokens
                    times[mode].append(r.done.figures.prefill_ms)
                    steps.append(r.done.figures.decode_ms / 8)
                short, exact, step = (statistics.median(v) for v in (times["short"], times["exact"], steps))
                print(f"| {name} | {new} | {table} | {short:.1f} | {exact:.1f} | {step:.1f} | {short / step:.2f} | {exact / step:.2f} |")
        finally:
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
        print("| format | " + " | ".join(f"T={t}" for t in TOKENS) + " | integer no slower up to T |")
        print("|---|" + "---:|" * (len(TOKENS) + 1))
        for fmt in args.formats.split(","):
            rows = measure(fmt, args.rows, args.inputs, args.rounds)
            wins = [t for t, a, b in rows if a <= b]
            # the crossover: the last T before the exact path starts to win for good
            limit = 0
            for t, a, b in rows:
                if a > b:
                    break
                limit = t
            summary.setdefault(variant, {})[fmt] = limit
            cells = " | ".join(f"{a:.2f}/{b:.2f}" for _, a, b in rows)
            print(f"| {fmt} | {cells} | {limit} |" + ("" if wins == [t for t in TOKENS if t <= limit] else " (not monotone)"))
        print("\n(cells: integer ms / exact ms)")
    kernels.use_variant(None)
    print("\nper variant, the crossover of each format (QFormat.short in layers/formats.py) = {")
    for variant, limits in summary.items():
        print(f"    {variant!r}: {limits!r},")
    print("}")


if __name__ == "__main__":
    main()
