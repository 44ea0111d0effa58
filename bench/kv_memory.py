"""KV memory in pages against a reservation per session: 32 named sessions of mixed lengths (half of them opening
with one shared system prompt), on the packaged SmolLM2-135M (the default model).

    python bench/kv_memory.py                         # 32 sessions, room 2048 each
    python bench/kv_memory.py --sessions 16 --max-seq 4096

Each session runs one prompt (lengths spread over 64 .. 1900 tokens, a fixed draw) and a short reply, and stays open,
so its K/V stays held. Then: the positions the model's pages hold (pages held x 64, a page shared by several sessions
once) and their bytes, against what a reservation of -max-seq positions for each session held before pages (today's
baseline: every session its whole room), and against the positions the sessions hold between them (the sum of their
lengths: what a cache without sharing would need at best).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sessions", type=int, default=32)
    ap.add_argument("--max-seq", type=int, default=2048)
    ap.add_argument("--reply", type=int, default=16, help="tokens generated per session")
    a = ap.parse_args()

    import torch

    from jitllmd.embedded import cache_dir, default_gguf
    from jitllmd.engine import kernels
    from jitllmd.engine.engine import Engine
    from jitllmd.engine.kv import PAGE
    from jitllmd.engine.loader import cached_conversion
    from jitllmd.engine.request import Generation
    from jitllmd.engine.sampler import SamplingParams

    kernels.configure(cache_dir() / "kernels")
    path = cached_conversion(default_gguf(), cache_dir())
    engine = Engine.load(path, max_batch=1, sessions=a.sessions, max_seq=a.max_seq)
    try:
        g = torch.Generator().manual_seed(0)
        system = torch.randint(100, 40000, (600,), generator=g).tolist()
        lengths = torch.randint(64, min(1900, a.max_seq - a.reply), (a.sessions,), generator=g).tolist()
        sessions = []
        for i, n in enumerate(lengths):
            own = torch.randint(100, 40000, (n,), generator=g).tolist()
            prompt = (system + own)[:n] if i % 2 else own  # every other session opens with the shared system prompt
            session = engine.new_session()
            for _ in engine.generate(Generation(prompt, SamplingParams(temperature=0), max_tokens=a.reply, ignore_eos=True, session=session)):
                pass
            sessions.append(session)
            print(f"\rsession {i + 1}/{a.sessions}: {len(session.token_ids)} positions", end="", file=sys.stderr)
        print(file=sys.stderr)
        pages = engine.loaded.kv_pages()
        per_position = sessions[0].kv.bytes_per_position()
        held = pages.held * PAGE
        lengths_sum = sum(s.kv.length for s in sessions)
        reserved = a.sessions * a.max_seq
        print(f"model: {path.name}, KV {sessions[0].kv.dtype} ({per_position} bytes a position), {a.sessions} sessions, -max-seq {a.max_seq}; "
              f"kernels: {kernels.describe()}")
        print()
        print("| what | positions | MB | vs a reservation per session |")
        print("|---|---:|---:|---:|")
        print(f"| a reservation of -max-seq per session (before pages) | {reserved} | {reserved * per_position / 1e6:.1f} | 1.00x |")
        print(f"| the sessions' lengths, summed | {lengths_sum} | {lengths_sum * per_position / 1e6:.1f} | {lengths_sum / reserved:.2f}x |")
        print(f"| pages held ({pages.held}, {pages.shared} shared) | {held} | {held * per_position / 1e6:.1f} | {held / reserved:.2f}x |")
        print()
        print(f"prefix cache: {pages.hit_tokens} of {pages.query_tokens} prompt tokens found; engine.loaded.kv_bytes() {engine.loaded.kv_bytes() / 1e6:.1f} MB")
    finally:
        engine.stop()


if __name__ == "__main__":
    main()
