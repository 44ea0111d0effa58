"""rows.c's attend_rows (a decode step's attention, one call for every single-token row) before and after a change to
it: the real models' head shapes over a paged cache, per kernel variant, the two builds timed in adjacent pairs (the
order flipping each pair) in one process, their outputs compared bit for bit.

    python bench/attend_kernel.py                                        # HEAD's rows.c against the working tree's
    python bench/attend_kernel.py --before /tmp/rows.c --variants avx2+fma --threads 1
    python bench/attend_kernel.py --layers 30 --kv f16,bf16              # each call a different layer's cache: from memory

Each build is every kernel source as the tree has it, with rows.c swapped for the version named (bench/rows_kernel.py's
build). The table gives each build's median microseconds a call and the
median of the pairs' after / before (with its quartiles): a shared machine's speed drifts within a run, and a pair
sees the same drift. With --layers N each call reads the next of N caches, as a step's layers do (N caches larger
than the caches of the CPU come from memory).
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import jitllmd  # noqa: E402,F401,I001  (first: it sets torch's OpenMP spin before torch loads, as the CLI does)
import torch  # noqa: E402

from bench.rows_kernel import build, per_call  # noqa: E402
from jitllmd.engine import kernels  # noqa: E402
from jitllmd.engine.kernels.ops import _RowMeta  # noqa: E402
from jitllmd.engine.pages import PAGE  # noqa: E402

# (name, rows, heads, kv heads, head size, positions): SmolLM2-135M (9 heads on 3), Qwen2.5-Coder-0.5B (14 on 2) and
# 1.5B (12 on 2, 128), Gemma 3 270M (4 on 1, 256); one row deep in a conversation, and 16 rows as a served step's
SHAPES = (("SmolLM2", 1, 9, 3, 64, 2048), ("SmolLM2", 16, 9, 3, 64, 200), ("Qwen2.5-0.5B", 1, 14, 2, 64, 2048),
          ("Qwen2.5-1.5B", 1, 12, 2, 128, 2048), ("Qwen2.5-1.5B", 8, 12, 2, 128, 300), ("Gemma 3 270M", 1, 4, 1, 256, 2048))
KV = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


class Case:
    """`layers` caches of `rows` rows' histories (random, paged in order) and one step's q, k, v."""

    def __init__(self, rows: int, heads: int, kv_heads: int, dim: int, length: int, dtype: torch.dtype, layers: int, gen: torch.Generator):
        pages = -(-length // PAGE)
        self.shape = rows, heads, kv_heads, dim
        self.tables = [(ctypes.c_int32 * pages)(*range(pages)) for _ in range(rows)]
        cache = [[torch.randn(pages, kv_heads, PAGE, dim, generator=gen).to(dtype) for _ in range(2 * rows)] for _ in range(layers)]
        self.metas = [_RowMeta(c[:rows], c[rows:], [length] * rows, [0] * rows, [ctypes.addressof(t) for t in self.tables]) for c in cache]
        self.cache = cache  # the metas point into these
        self.q, self.k, self.v = (torch.randn(rows, h, dim, generator=gen) for h in (heads, kv_heads, kv_heads))
        self.next = 0

    def call(self, lib: ctypes.CDLL, out: torch.Tensor, threads: int, layer: int | None = None) -> None:
        if layer is None:
            layer, self.next = self.next, (self.next + 1) % len(self.metas)
        rows, heads, kv_heads, dim = self.shape
        meta = self.metas[layer]
        rc = lib.attend_rows(self.q.data_ptr(), self.k.data_ptr(), self.v.data_ptr(), out.data_ptr(), *meta.pointers, rows, heads, kv_heads, dim,
                             dim**-0.5, meta.kind, threads)
        assert rc == 0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--before", help="rows.c to compare against (default: HEAD's)")
    p.add_argument("--after", default=str(ROOT / "jitllmd/engine/kernels/rows.c"))
    p.add_argument("--variants", default=",".join(kernels.variants()))
    p.add_argument("--kv", default="f16", help="comma-separated cache dtypes, of: " + ", ".join(KV))
    p.add_argument("--pairs", type=int, default=30)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--layers", type=int, default=1, help="caches each build's calls cycle through (30: a SmolLM2 step's)")
    p.add_argument("--budget", type=float, default=0.05, help="seconds of calls per timing")
    args = p.parse_args()
    before = Path(args.before).read_text() if args.before else subprocess.check_output(
        ["git", "show", "HEAD:jitllmd/engine/kernels/rows.c"], cwd=ROOT, text=True)
    after = Path(args.after).read_text()
    gen = torch.Generator().manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        for variant in args.variants.split(","):
            libs = (build(before, variant, Path(tmp) / "before", "rows.c"), build(after, variant, Path(tmp) / "after", "rows.c"))
            print(f"\n## attend_rows, {variant}, {args.threads} threads, {args.layers} cache(s) a shape, {args.pairs} interleaved pairs\n")
            print("| model | rows | heads / kv heads | head size | positions | kv | before us | after us | after / before (quartiles) |")
            print("|---|---:|---:|---:|---:|---|---:|---:|---:|")
            for name, rows, heads, kv_heads, dim, length in SHAPES:
                for kv in args.kv.split(","):
                    case = Case(rows, heads, kv_heads, dim, length, KV[kv], args.layers, gen)
                    outs = [torch.empty(rows, heads * dim) for _ in libs]
                    for lib, out in zip(libs, outs):
                        case.call(lib, out, args.threads, layer=0)
                    assert torch.equal(outs[0], outs[1]), f"{variant} {name} {kv}: the builds' results differ"
                    times: list[list[float]] = [[], []]
                    ratios = []
                    for r in range(args.pairs):
                        got = [0.0, 0.0]
                        for i in (0, 1) if r % 2 == 0 else (1, 0):
                            got[i] = per_call(functools.partial(case.call, libs[i], outs[i], args.threads), args.budget)
                            times[i].append(got[i])
                        ratios.append(got[1] / got[0])
                    b, a = (1e6 * statistics.median(t) for t in times)
                    q1, mid, q3 = statistics.quantiles(ratios, n=4)
                    print(f"| {name} | {rows} | {heads} / {kv_heads} | {dim} | {length} | {kv} | {b:.1f} | {a:.1f} | {mid:.3f} ({q1:.3f}-{q3:.3f}) |",
                          flush=True)


if __name__ == "__main__":
    main()
