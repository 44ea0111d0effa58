"""A conversation's next turn after its KV pages left the pool, against one whose pages stayed and one that lost them
(what a server without a place to put them does: the whole conversation fed again), on Qwen2.5-Coder-0.5B Q4_K_M.

    python bench/kv_spill.py                      # a 2,000-token conversation, 5 rounds
    python bench/kv_spill.py --tokens 4000 --rounds 3 --kernel avx2+fma

One named session holds a conversation of --tokens positions. Each round, in turn (interleaved, so drift hits all
alike): its pages stay in the pool; they go to the spill file (-maxmem's way for a host model, kv_spill.py) and come
back for the turn; they are dropped and the turn feeds the whole conversation. Each asks the same 20-token follow-up
and times the first token (TTFT, median of the rounds), the spill's own cost and the bytes moved; the tokens after a
spill are checked equal to those of the pages that stayed (recomputing may round otherwise: a whole prompt's
products). Prints the table and each way against recomputing.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=2000, help="positions the conversation holds")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--kernel", default=None, help="force a kernel variant (avx2+fma, avx512, ...)")
    a = ap.parse_args()

    import torch

    from bench.vs_llamacpp import qwen_q4_k_m
    from jitllmd.embedded import cache_dir
    from jitllmd.engine import kernels
    from jitllmd.engine.engine import Engine
    from jitllmd.engine.loader import cached_conversion
    from jitllmd.engine.request import Delta, Generation
    from jitllmd.engine.sampler import SamplingParams

    kernels.configure(cache_dir() / "kernels")
    if a.kernel:
        kernels.use_variant(a.kernel)
    path = cached_conversion(qwen_q4_k_m(), cache_dir() / "bench")
    engine = Engine.load(path, max_seq=a.tokens + 256, prefix_cache=False)  # recomputing finds no cached pages
    greedy = SamplingParams(temperature=0)
    g = torch.Generator().manual_seed(0)
    history = torch.randint(100, 40000, (a.tokens,), generator=g).tolist()
    follow = torch.randint(100, 40000, (20,), generator=g).tolist()
    session = engine.new_session()

    def ask(prompt: list[int], n: int) -> tuple[float, list[int]]:
        t0 = time.perf_counter()
        first, ids = None, []
        for ev in engine.generate(Generation(prompt, greedy, max_tokens=n, ignore_eos=True, session=session)):
            if isinstance(ev, Delta):
                first = first or time.perf_counter() - t0
                ids += ev.token_ids
        assert first is not None
        return first * 1000, ids

    try:
        ask(history, 1)
        held = list(session.token_ids)
        bytes_moved = session.kv.nbytes()
        print(f"model {path.name}, kernels {kernels.variant()}, conversation {len(held)} positions, {bytes_moved / 2**20:.1f} MiB of K/V", file=sys.stderr)
        ttft: dict[str, list[float]] = {"pages stayed": [], "spilled to the file": [], "recomputed": []}
        spill_ms: list[float] = []
        tokens: dict[str, list[int]] = {}
        for r in range(a.rounds):
            for way in ttft:
                if way == "spilled to the file":
                    t0 = time.perf_counter()
                    engine.run_job(session.kv.spill, session).result()
                    spill_ms.append((time.perf_counter() - t0) * 1000)
                    assert engine.loaded.kv_pages().file > 0
                elif way == "recomputed":
                    engine.run_job(session.reset, session).result()
                ms, ids = ask(held + follow, 8)
                ttft[way].append(ms)
                assert tokens.setdefault(way, ids) == ids
                engine.run_job(lambda: session.kv.truncate(len(held)), session).result()  # back to the conversation
                del session.token_ids[len(held):]
            print(f"round {r + 1}/{a.rounds}: " + ", ".join(f"{w} {v[-1]:.0f} ms" for w, v in ttft.items()), file=sys.stderr)
        same = tokens["spilled to the file"] == tokens["pages stayed"]  # the same K/V bits: the same tokens
        recomputed = "the same" if tokens["recomputed"] == tokens["pages stayed"] else "others (its prompt ran as a chunk, not a short feed)"
        base = statistics.median(ttft["recomputed"])
        print(f"\n| next turn of a {len(held)}-position conversation | TTFT p50 ms | vs recomputed |")
        print("|---|---:|---:|")
        for way, values in ttft.items():
            print(f"| {way} | {statistics.median(values):.0f} | {statistics.median(values) / base:.2f}x |")
        print(f"\nspill (pool -> file) p50 {statistics.median(spill_ms):.0f} ms for {bytes_moved / 2**20:.1f} MiB; tokens after a spill equal the "
              f"pages' that stayed: {same}; recomputing gave {recomputed}")
    finally:
        engine.stop()


if __name__ == "__main__":
    main()
