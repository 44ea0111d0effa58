"""Continuous batching: N concurrent streaming clients against `jitllmd serve -devices cpu` on SmolLM2, one run.

    python bench/batch.py                            # N = 1, 2, 4, 8, 16; f32; 64 generated tokens each
    python bench/batch.py --clients 1,8 --dtype bf16 --joint-steps always

For each N, N clients stream a completion at once (different prompts, greedy, ignore_eos so every client generates
the same number of tokens). Prints aggregate generated tokens/s, mean per-client tokens/s, time to first token p50 and
p95, and the speedup of the aggregate over N = 1.
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

from bench.decode import TEXT, prepare  # noqa: E402
from bench.serve import start_server, stream_completion  # noqa: E402


def client(url: str, prompt: str, n: int, out: list[dict]) -> None:
    import httpx

    body = {"model": "smol", "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True}
    t0, stamps = stream_completion(httpx, url, body)
    out.append({"t0": t0, "ttft": stamps[0] - t0, "end": stamps[-1], "tokens": n, "tps": (len(stamps) - 1) / (stamps[-1] - stamps[0])})


def run(url: str, num: int, n: int) -> dict[str, float]:
    results: list[dict] = []
    words = TEXT.split()
    prompts = [" ".join(words[i % len(words) :] + words[: i % len(words)])[:300] for i in range(num)]
    threads = [threading.Thread(target=client, args=(url, p, n, results)) for p in prompts]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = max(r["end"] for r in results) - start
    ttfts = sorted(r["ttft"] for r in results)
    return {
        "aggregate": sum(r["tokens"] for r in results) / wall,
        "per_client": statistics.mean(r["tps"] for r in results),
        "ttft_p50": statistics.median(ttfts) * 1000,
        "ttft_p95": ttfts[min(len(ttfts) - 1, int(0.95 * len(ttfts)))] * 1000,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", default="1,2,4,8,16")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--dtype", default="f32", choices=("f32", "bf16"))
    ap.add_argument("--joint-steps", default="auto", choices=("auto", "always", "never"))
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    counts = [int(c) for c in a.clients.split(",")]
    path = prepare()[a.dtype]
    rows = str(max(counts))
    proc, url = start_server(path, "smol", "-devices", "cpu", "-sessions", rows, "-max-batch", rows, "-max-seq", "1024", "-joint-steps", a.joint_steps)
    results: dict[int, list[dict[str, float]]] = {}
    try:
        run(url, max(counts), 8)  # warm up, and let auto meet the row counts
        for r in range(a.rounds):
            for num in counts:
                res = run(url, num, a.tokens)
                results.setdefault(num, []).append(res)
                print(f"round {r + 1} N={num}: {res}", file=sys.stderr)
    finally:
        proc.terminate()
        proc.wait()
    med = {num: {k: statistics.median(x[k] for x in v) for k in v[0]} for num, v in results.items()}
    base = med[counts[0]]["aggregate"]
    print(f"\nSmolLM2-135M-Instruct {a.dtype}, serve -devices cpu -sessions {max(counts)} -max-batch {max(counts)} -joint-steps {a.joint_steps}, "
          f"{a.tokens} generated tokens per client, median of {a.rounds} rounds")
    print("| clients | aggregate tok/s | per-client tok/s | TTFT p50 ms | TTFT p95 ms | speedup vs N=1 |")
    print("|---:|---:|---:|---:|---:|---:|")
    for num in counts:
        m = med[num]
        print(f"| {num} | {m['aggregate']:.1f} | {m['per_client']:.1f} | {m['ttft_p50']:.0f} | {m['ttft_p95']:.0f} | **{m['aggregate'] / base:.2f}x** |")


if __name__ == "__main__":
    main()
