"""quant.c's quant_rows (or, with --gemm, its int8 GEMM gemm_rows) before and after a change to it: T = 1 .. 16 x rows
(--gemm: 64 and 512) against the real models' projection shapes, per kernel variant, the two builds interleaved round
by round in one process (medians), their results compared bit for bit.

    python bench/rows_kernel.py                                  # HEAD's quant.c against the working tree's
    python bench/rows_kernel.py --before /tmp/quant.c --variants avx512+vnni --rounds 9 --threads 1
    python bench/rows_kernel.py --gemm --variants avx2+fma,avx2+vnni --shapes Q8_0,Q6_K
    python bench/rows_kernel.py --before /tmp/quant-1.c --before-ggml   # a quant.c of .jlm format 1 (ggml's K order)

Each build is every kernel source as the tree has it, with quant.c swapped for the version named, compiled with the
variant's flags as kernels/build.py compiles them.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import jitllmd  # noqa: E402,F401  (first: it sets torch's OpenMP spin before torch loads, as the CLI does)
import torch  # noqa: E402

from bench.kernels_vs_llamacpp import weight_shapes  # noqa: E402
from bench.short_prompt import weight  # noqa: E402
from jitllmd.engine import kernels  # noqa: E402
from jitllmd.engine.kernels import build as kernel_build  # noqa: E402
from jitllmd.engine.layers.formats import FORMATS, to_lanes  # noqa: E402

TOKENS = (1, 2, 4, 8, 12, 16)
# (format, N, K): SmolLM2-135M Q4_1's gate_up and down, a Q8_0 square and SmolLM2 Q8_0's gate_up and down, Gemma 3's Q8_0 head's K (640: a
# last group of 4 blocks), Qwen2.5-0.5B Q4_K_M's gate_up (Q5_0: K = 896 is no multiple of 256) and down (Q4_K, Q6_K)
SHAPES = (("Q4_1", 3072, 576), ("Q4_1", 576, 1536), ("Q8_0", 576, 576), ("Q8_0", 3072, 576), ("Q8_0", 576, 1536), ("Q8_0", 2048, 640), ("Q5_0", 9728, 896), ("Q4_K", 896, 4864), ("Q6_K", 896, 4864))


def build(text: str, variant: str, out: Path, name: str = "quant.c") -> ctypes.CDLL:
    """The kernels with source `name`'s text `text` (the tree's others), built as `variant` into out/."""
    src = out / variant.replace("+", "-")
    src.mkdir(parents=True)
    for path in [*kernel_build._SOURCES, *kernel_build._HEADERS]:
        (src / path.name).write_text(text if path.name == name else path.read_text())
    so = src / "kernels.so"
    flags = [*kernel_build._FLAGS, *kernel_build._VARIANTS[variant][0]]
    subprocess.run(["cc", *flags, *(str(src / p.name) for p in kernel_build._SOURCES), "-o", str(so)], check=True)
    lib = ctypes.CDLL(str(so))
    kernel_build._declare(lib)
    return lib


def call(lib: ctypes.CDLL, x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, qtype: int, threads: int, gemm: bool = False) -> None:
    T, K = x.shape
    N = y.shape[1]
    fn = lib.gemm_rows if gemm else lib.quant_rows
    assert fn(x.data_ptr(), w.data_ptr(), y.data_ptr(), T, K, N, N, qtype, 0, None, 0.0, None, 0, threads) == 0


def per_call(fn, budget: float) -> float:
    """Seconds per call of fn, over as many calls as fit `budget` seconds (at least 3)."""
    fn()
    t0 = time.perf_counter()
    fn()
    reps = max(3, int(budget / max(time.perf_counter() - t0, 1e-7)))
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--before", help="quant.c to compare against (default: HEAD's)")
    p.add_argument("--after", default=str(ROOT / "jitllmd/engine/kernels/quant.c"))
    p.add_argument("--variants", default=",".join(kernels.variants()))
    p.add_argument("--shapes", default="", help="comma-separated formats to keep (default: all)")
    p.add_argument("--dims", type=weight_shapes, default=None, help="comma-separated N x K (K a multiple of 256) each kept format runs at instead of its shapes, "
                   "e.g. 1024x1536,128x8960: weights that stay in L2")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--budget", type=float, default=0.02, help="seconds of calls per timing")
    p.add_argument("--tokens", default=None, help=f"x rows per call (default {','.join(map(str, TOKENS))}; --gemm: 64,512)")
    p.add_argument("--gemm", action="store_true", help="time gemm_rows, a prompt chunk's int8 GEMM, instead of quant_rows")
    p.add_argument("--least", action="store_true", help="each build's least time of its rounds, not the median (a busy machine's noise only adds)")
    p.add_argument("--before-ggml", action="store_true", help="the before build reads K-format blocks in ggml's order (a quant.c from before "
                   "479e064, .jlm format version 1): it gets them so, the after build the same blocks in lane order")
    args = p.parse_args()
    tokens = args.tokens or ("64,512" if args.gemm else ",".join(map(str, TOKENS)))
    before = Path(args.before).read_text() if args.before else subprocess.check_output(
        ["git", "show", "HEAD:jitllmd/engine/kernels/quant.c"], cwd=ROOT, text=True)
    after = Path(args.after).read_text()
    keep = set(filter(None, args.shapes.split(",")))
    shapes = list(SHAPES)
    if args.dims:
        shapes = [(fmt, n, k) for fmt in dict.fromkeys(f for f, _, _ in SHAPES) for n, k in args.dims]
    gen = torch.Generator().manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        for variant in args.variants.split(","):
            libs = (build(before, variant, Path(tmp) / "before"), build(after, variant, Path(tmp) / "after"))
            stat = min if args.least else statistics.median
            kind = "gemm_rows" if args.gemm else "quant_rows"
            print(f"\n## {kind}, {variant}, {args.threads} threads, {stat.__name__} of {args.rounds} interleaved rounds\n")
            print("| format | N x K | T | before us | after us | after / before | after / its first T |")
            print("|---|---|---:|---:|---:|---:|---:|")
            for fmt, n, k in shapes:
                if keep and fmt not in keep:
                    continue
                qtype, w = FORMATS[fmt].ggml, weight(fmt, n, k, gen)  # the engine's order (lane order for K-formats)
                ws = (to_lanes(w.view(-1, FORMATS[fmt].nbytes), FORMATS[fmt]).view(w.shape) if args.before_ggml else w, w)
                one = None
                for T in map(int, tokens.split(",")):
                    x = torch.randn(T, k, generator=gen)
                    ys = [torch.empty(T, n) for _ in libs]
                    times: list[list[float]] = [[], []]
                    for r in range(args.rounds):
                        for i in (0, 1) if r % 2 == 0 else (1, 0):
                            times[i].append(per_call(lambda: call(libs[i], x, ws[i], ys[i], qtype, args.threads, args.gemm), args.budget))
                    assert torch.equal(ys[0], ys[1]), f"{variant} {fmt} T={T}: the builds' results differ"
                    b, a = (1e6 * stat(t) for t in times)
                    one = a if one is None else one
                    print(f"| {fmt} | {n} x {k} | {T} | {b:.1f} | {a:.1f} | {a / b:.2f} | {a / one:.2f} |", flush=True)


if __name__ == "__main__":
    main()
