"""The sessions' K/V in f16 against q8_0 (-kv-dtype), on the real models: perplexity on bench/data (as
bench/vs_llamacpp.py measures it, windows of --ctx tokens) and batch-1 decode at depth (a --depth-token history,
then --tokens greedy tokens), each dtype in turn in one process, rounds interleaved, medians.

    python bench/kv_dtype.py                                   # Qwen2.5-Coder-0.5B Q4_K_M, depth 4096
    python bench/kv_dtype.py --model smol --depth 2048         # the packaged SmolLM2-135M
    python bench/kv_dtype.py --kernel avx2+fma                 # jitllmd's AVX2 kernels forced

Decode at depth reads the history's K/V every token: q8_0 reads 34 bytes a block of 32 values where f16 reads 64, so
the bytes a token reads (weights + K/V, the `jitllm` figure's arithmetic) fall, and the table shows what that buys.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TEXT = ROOT / "bench" / "data" / "public_domain.txt"
DTYPES = ("f16", "q8_0")


def perplexity(loaded, ctx: int) -> float:
    """llama-perplexity's rule (bench/vs_llamacpp.py worker_ppl): windows of ctx tokens, each in a fresh session, its
    first token BOS where the vocab adds one, scored from ctx/2 on."""
    import torch

    from jitllmd.engine.kv import RowSpan

    tok = loaded.tokenizer
    ids = tok.encode(TEXT.read_text().removesuffix("\n"))
    first, nll, count = ctx // 2, 0.0, 0
    for c in range(len(ids) // ctx):
        window = ids[c * ctx : (c + 1) * ctx]
        if tok.add_bos_token:
            window[0] = tok.bos_token_id
        logits = loaded.runner.forward(torch.tensor(window), torch.arange(ctx), [RowSpan(0, ctx, loaded.new_kv(), prompt=True)], torch.arange(first, ctx - 1))
        logp = torch.log_softmax(logits.double(), dim=-1)
        nll -= logp.gather(1, torch.tensor(window[first + 1 :]).view(-1, 1)).sum().item()
        count += ctx - 1 - first
    return math.exp(nll / count)


def decode_at_depth(engine, depth: int, tokens: int) -> tuple[float, float]:
    """tok/s of `tokens` greedy tokens after a `depth`-token history (the history fed once, in a named session), and the
    bytes a token read (jitllm figure)."""
    import torch

    from jitllmd.engine.request import Done, Generation
    from jitllmd.engine.sampler import SamplingParams

    g = torch.Generator().manual_seed(1)
    history = torch.randint(100, 20000, (depth,), generator=g).tolist()
    session = engine.new_session()
    greedy = SamplingParams(temperature=0)
    for _ in engine.generate(Generation(history, greedy, max_tokens=1, ignore_eos=True, session=session)):
        pass
    t0, done = time.perf_counter(), None
    for ev in engine.generate(Generation(session.token_ids + [11], greedy, max_tokens=tokens, ignore_eos=True, session=session)):
        if isinstance(ev, Done):
            done = ev
    assert done is not None
    figures = done.figures
    return figures.decode_tokens_per_second, float(figures.bytes_per_token)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen-0.5b", choices=("qwen-0.5b", "qwen-1.5b", "smol"))
    ap.add_argument("--depth", type=int, default=4096)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--ctx", type=int, default=512, help="perplexity window")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--kernel", default=None, help="force a kernel variant (e.g. avx2+fma)")
    a = ap.parse_args()

    import jitllmd  # noqa: F401  (torch's OpenMP settings, as the CLI has them)
    from bench.speculative import models
    from jitllmd.embedded import cache_dir
    from jitllmd.engine import kernels
    from jitllmd.engine.engine import Engine
    from jitllmd.engine.loader import cached_conversion

    kernels.configure(cache_dir() / "kernels")
    if a.kernel:
        kernels.use_variant(a.kernel)
    gguf = models()[a.model]
    path = cached_conversion(gguf, cache_dir() / "bench")
    engines = {d: Engine.load(path, max_seq=a.depth + a.tokens + 16, kv_dtype=d) for d in DTYPES}
    try:
        ppl = {d: perplexity(engines[d].loaded, a.ctx) for d in DTYPES}
        rates: dict[str, list[float]] = {d: [] for d in DTYPES}
        bytes_read: dict[str, float] = {}
        for r in range(a.rounds):
            for d in DTYPES if r % 2 == 0 else DTYPES[::-1]:
                rate, per_token = decode_at_depth(engines[d], a.depth, a.tokens)
                rates[d].append(rate)
                bytes_read[d] = per_token
                print(f"round {r + 1} {d}: {rate:.2f} tok/s", file=sys.stderr)
        kv_bytes = {d: engines[d].loaded.runner.kv_pool.page_bytes // 64 * len(engines[d].loaded.runner.kv_pool.windows) for d in DTYPES}
    finally:
        for e in engines.values():
            e.stop()
    print(f"model: {gguf.name}; kernels: {kernels.describe()}; depth {a.depth}, {a.tokens} tokens, medians of {a.rounds}; perplexity windows of {a.ctx}")
    print()
    print("| -kv-dtype | K/V bytes a position | perplexity | vs f16 | MB read a token | decode tok/s at depth | vs f16 |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    base_ppl, base_rate = ppl["f16"], statistics.median(rates["f16"])
    for d in DTYPES:
        rate = statistics.median(rates[d])
        print(f"| {d} | {kv_bytes[d]} | {ppl[d]:.4f} | {ppl[d] / base_ppl - 1:+.2%} | {bytes_read[d] / 1e6:.1f} | {rate:.2f} | {rate / base_rate:.2f}x |")


if __name__ == "__main__":
    main()
