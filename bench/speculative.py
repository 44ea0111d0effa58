"""Speculative decoding, served, one client: jitllmd without it, with prompt lookup and with a draft model, against
llama-server without it, with its prompt lookup (ngram-simple) and with the same draft model; then 8 streaming clients
with guesses against without.

    python bench/speculative.py                                  # Qwen2.5-Coder-1.5B Q4_K_M, drafted by the 0.5B
    python bench/speculative.py --rounds 2 --kernel avx2+fma     # jitllmd's AVX2 kernels forced (LLAMACPP_ISA=avx2 peer)
    python bench/speculative.py --target smol --draft smol       # a quick look on SmolLM2 (Q4_1, drafting for itself)

Every server is started once and stays up (idle ones take no CPU); each round sends each prompt to each server in
turn, the order rotating a round. A request is one streamed /v1/chat/completions, greedy, max_tokens fixed, through
the same client for both engines; its decode rate is (tokens - 1) / (last token - first token) as the client saw
them, and the table shows medians over rounds with each ratio to jitllmd without speculation. The prompts: (a)
"edit": a ~300-token Python function to return whole with one change (what prompt lookup is for), (b) "chat": an open
question. jitllmd's acceptance is its own figure (jitllm.accepted_tokens / drafted_tokens).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.served import FORCED, Server, ServerFailed, free_port  # noqa: E402

EDIT = '''def schedule(self) -> list[tuple[Request, int]]:
    """Admit what fits, then the rows of the next step as (request, tokens to feed)."""
    self.running = [r for r in self.running if not r.finished]
    self._admit()
    rows: list[tuple[Request, int]] = []
    budget = self.prompt_chunk
    for req in self.running:
        if req.state is RequestState.DECODE:
            rows.append((req, 1))
        elif budget > 0:
            n = min(req.prompt_left, budget)
            budget -= n
            rows.append((req, n))
    return rows


def feed(self, rows: list[tuple[Request, int]], short_feed: int = 0) -> list[Row]:
    """What each scheduled row feeds this step."""
    out = []
    now = time.perf_counter()
    for req, n in rows:
        if req.cancel_requested:
            out.append(Row(req, [], req.session.kv.length, False, False, False, 0))
            continue
        if req.t_first_step is None:
            req.t_first_step = now
            req.cached = req.session.reuse_prefix(req.prompt_ids)
            req.fed = req.cached
            n = min(n, req.prompt_left)
        prompt = req.state is not RequestState.DECODE
        ids = req.prompt_ids[req.fed : req.fed + n] if prompt else [req.next_token]
        pos = req.session.kv.length
        req.session.token_ids.extend(ids)
        if req.state is RequestState.PREFILL:
            req.fed += len(ids)
        out.append(Row(req, ids, pos, prompt, False, False, 1))
    return out
'''
PROMPTS = {
    "edit": "Rename the variable `budget` to `token_budget` in this code. Reply with the whole code and nothing else.\n\n```python\n" + EDIT + "```",
    "chat": "What are the trade-offs between threads and processes for a Python web server? Answer in a few paragraphs.",
}
CONFIGS = ("jitllmd", "jitllmd ngram", "jitllmd draft", "llama-server", "llama-server ngram", "llama-server draft")


def models() -> dict[str, Path]:
    from bench.convert import qwen_1_5b
    from jitllmd.embedded import default_gguf
    from tests.conftest import join_qwen_gguf

    found = {"qwen-1.5b": qwen_1_5b(), "qwen-0.5b": join_qwen_gguf(), "smol": default_gguf()}
    return {k: v for k, v in found.items() if v is not None}


def jitllmd_cmd(models_dir: Path, target: str, draft: str | None, spec: str, port: int, kernel: str | None, sessions: int) -> list[str]:
    head = [sys.executable, "-c", FORCED, kernel] if kernel else [sys.executable, "-m", "jitllmd"]
    cmd = [*head, "serve", "-addr", f"127.0.0.1:{port}", "-models", str(models_dir), "-load", target, "-id", "m", "-devices", "cpu",
           "-sessions", str(sessions), "-max-seq", "2048", "-spec", spec]
    return cmd + (["-draft", draft] if draft else [])


def llama_cmd(bin_dir: Path, target: Path, draft: Path | None, port: int, threads: int, ngram: bool = False) -> list[str]:
    """llama-server with one slot; with its draft model (up to 8 guesses, as jitllmd's -draft-max), or its own prompt
    lookup (`--spec-type ngram-simple`)."""
    cmd = [str(bin_dir / "llama-server"), "-m", str(target), "-np", "1", "-c", "2048", "-t", str(threads), "--no-repack",
           "--host", "127.0.0.1", "--port", str(port)]
    if ngram:
        return cmd + ["--spec-type", "ngram-simple"]
    return cmd + (["--model-draft", str(draft), "--spec-draft-n-max", "8", "-td", str(threads)] if draft else [])


def one(url: str, prompt: str, max_tokens: int) -> dict:
    """A streamed greedy chat: decode tok/s as the client saw it, tokens, and jitllmd's guesses where it says."""
    body = {"model": "m", "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    first = last = 0.0
    tokens, figures, text = 0, {}, []
    with httpx.Client(trust_env=False, timeout=1800) as client, client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise ServerFailed(f"HTTP {r.status_code}: {r.read().decode(errors='replace')[:160]}")
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            obj = json.loads(line[6:])
            figures = obj.get("jitllm") or figures
            if obj.get("usage"):
                tokens = obj["usage"]["completion_tokens"]
            for choice in obj.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    now = time.perf_counter()
                    first = first or now
                    last = now
                    text.append(piece)
    rate = (tokens - 1) / (last - first) if last > first and tokens > 1 else 0.0
    return {"rate": rate, "tokens": tokens, "drafted": figures.get("drafted_tokens", 0), "accepted": figures.get("accepted_tokens", 0),
            "text": "".join(text)}


def batched(url: str, clients: int, max_tokens: int) -> float:
    """`clients` streaming chats at once (the chat prompt, each with its own number first): aggregate tok/s."""
    got: list[dict] = [{}] * clients

    def go(i: int) -> None:
        got[i] = one(url, f"Question {i}. " + PROMPTS["chat"], max_tokens)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=go, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(g["tokens"] for g in got) / (time.perf_counter() - t0)


_COST = """
import json, statistics, sys, time
import jitllmd  # noqa: F401  (first, as the CLI runs it)
import torch
from jitllmd.engine import kernels
from jitllmd.engine.kv import RowSpan
from jitllmd.engine.loader import load_model
if sys.argv[2] != "-":
    kernels.use_variant(sys.argv[2])
loaded = load_model(sys.argv[1], max_seq=1024)
run = loaded.runner
kv = loaded.new_kv(1024)
ids = torch.arange(300) % 1000 + 100
run.forward(ids, torch.arange(300), [RowSpan(0, 300, kv, prompt=True)], torch.tensor([299]))
out = {}
for rnd in range(7):
    for t in (1, 2, 3, 5, 9):
        toks = torch.arange(t) + 200
        t0 = time.perf_counter()
        run.forward(toks, torch.arange(300, 300 + t), [RowSpan(0, t, kv, short=True)], torch.arange(t))
        out.setdefault(t, []).append(time.perf_counter() - t0)
        kv.truncate(300)
print(json.dumps({t: statistics.median(v) for t, v in out.items()}))
"""


def token_costs(path: Path, kernel: str | None) -> dict[int, float]:
    """A verifying row of t tokens (a short feed at depth 300) against one token, in its own process: step seconds."""
    import subprocess

    r = subprocess.run([sys.executable, "-c", _COST, str(path), kernel or "-"], capture_output=True, text=True, timeout=1800, check=True)
    return {int(k): v for k, v in json.loads(r.stdout.strip().splitlines()[-1]).items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="qwen-1.5b")
    ap.add_argument("--draft", default="qwen-0.5b")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=320)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kernel", default=None, help="jitllmd's kernel variant forced, e.g. avx2+fma")
    ap.add_argument("--clients", type=int, default=8, help="the batched comparison's streaming clients (0: none)")
    ap.add_argument("--no-llama", action="store_true", help="jitllmd alone")
    args = ap.parse_args()

    from bench.vs_llamacpp import cache, llama_bin

    found = models()
    target, draft = found[args.target], found[args.draft]
    models_dir = cache() / "spec-models"
    models_dir.mkdir(exist_ok=True)
    for p in (target, draft):
        link = models_dir / p.name
        if not link.exists():
            link.unlink(missing_ok=True)
            link.symlink_to(p.resolve())
    from jitllmd.embedded import cache_dir
    from jitllmd.engine.loader import cached_conversion

    for name, p in (("target", target), ("draft", draft)):
        costs = token_costs(cached_conversion(p, cache_dir()), args.kernel)
        one_token = costs[1]
        print(f"{name} {p.name}: a step of one row feeding t tokens, x one token's: "
              + ", ".join(f"t={t} {v / one_token:.2f}" for t, v in costs.items()) + f" (one token {1000 * one_token:.1f} ms)", flush=True)
    bin_dir = None if args.no_llama else llama_bin()
    configs = [c for c in CONFIGS if not (args.no_llama and c.startswith("llama"))]
    servers: dict[str, Server] = {}
    try:
        for c in configs:
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            if c.startswith("llama"):
                assert bin_dir is not None
                servers[c] = Server(llama_cmd(bin_dir, target, draft if c.endswith("draft") else None, port, args.threads, c.endswith("ngram")),
                                    url, "/health")
            else:
                spec = {"jitllmd": "off", "jitllmd ngram": "ngram", "jitllmd draft": "draft"}[c]
                servers[c] = Server(jitllmd_cmd(models_dir, target.name, draft.name if spec == "draft" else None, spec, port, args.kernel,
                                                max(1, args.clients)), url, "/healthz")
            servers[c].wait_healthy()  # one at a time: loading (and converting, the first time) is not measured
            one(servers[c].url, "Hi", 8)  # warm
        got: dict[tuple[str, str], list[dict]] = {}
        for r in range(args.rounds):
            order = configs[r % len(configs) :] + configs[: r % len(configs)]
            for name, prompt in PROMPTS.items():
                for c in order:
                    res = one(servers[c].url, prompt, args.tokens)
                    got.setdefault((c, name), []).append(res)
                    acc = f", {res['accepted']}/{res['drafted']} taken" if res["drafted"] else ""
                    print(f"round {r + 1} {name:4} {c:18} {res['rate']:6.1f} tok/s ({res['tokens']} tokens{acc})", file=sys.stderr, flush=True)
        batch: dict[str, list[float]] = {}
        if args.clients:
            for r in range(args.rounds):
                for c in ("jitllmd", "jitllmd ngram", "jitllmd draft")[:: 1 if r % 2 == 0 else -1]:
                    batch.setdefault(c, []).append(batched(servers[c].url, args.clients, 128))
                    print(f"round {r + 1} {args.clients} clients {c:18} {batch[c][-1]:6.1f} tok/s", file=sys.stderr, flush=True)
    finally:
        for s in servers.values():
            s.stop()

    med = lambda xs: statistics.median(xs) if xs else 0.0  # noqa: E731
    kernel = f", jitllmd kernels {args.kernel} forced" if args.kernel else ""
    print(f"\n{target.name} drafted by {draft.name}, {args.threads} threads{kernel}, greedy, {args.tokens} tokens, medians of {args.rounds} rounds")
    print("| config | " + " | ".join(f"{n} tok/s | x jitllmd | taken" for n in PROMPTS) + " |")
    print("|---|" + "---:|---:|---:|" * len(PROMPTS))
    for c in configs:
        cells = []
        for name in PROMPTS:
            runs = got[(c, name)]
            rate, base = med([x["rate"] for x in runs]), med([x["rate"] for x in got[("jitllmd", name)]])
            drafted, accepted = sum(x["drafted"] for x in runs), sum(x["accepted"] for x in runs)
            same = "" if c.startswith("llama") or all(x["text"] == y["text"] for x, y in zip(runs, got[("jitllmd", name)])) else " (text differs!)"
            cells.append(f"{rate:.1f}{same} | {rate / base:.2f} | {f'{accepted / drafted:.0%}' if drafted else ''}")
        print(f"| {c} | " + " | ".join(cells) + " |")
    for name in PROMPTS:
        best_llama = max((med([x["rate"] for x in got[(c, name)]]) for c in configs if c.startswith("llama")), default=0.0)
        ours = max(med([x["rate"] for x in got[(c, name)]]) for c in configs if c.startswith("jitllmd"))
        if best_llama:
            print(f"{name}: jitllmd's best {ours:.1f} / llama-server's best {best_llama:.1f} = {ours / best_llama:.2f}x")
    if batch:
        base = med(batch["jitllmd"])
        print(f"\n{args.clients} streaming clients, 128 tokens each, aggregate tok/s: " + ", ".join(f"{c} {med(v):.1f} ({med(v) / base:.2f}x)" for c, v in batch.items()))


if __name__ == "__main__":
    main()
