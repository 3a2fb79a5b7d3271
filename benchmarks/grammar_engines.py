"""Grammar engines side by side: the per-token cost of a JSON-schema mask inside a batch of rows.

Each engine compiles one schema for the real SmolLM2 tokenizer, then drives `--rows` matchers
(64 by default, as in a full batch) through the tokens of a different valid instance each: at
every step each row fills its next-token mask and accepts its token, as a decode step would.
Reported per engine: the schema's compile time, microseconds per row-token (mask + advance), and
the milliseconds a step of all rows costs, serially, best of `--repeats`; `llguidance-par` is
llguidance as the server runs it, a step's masks in one call on its own threads (the machine's
cores decide what that buys). The engines run one
after another in one process on the same tokens; the machine's load is printed beside them.

    python benchmarks/grammar_engines.py [--rows 64] [--repeats 3] [--model smollm2-135m] [--json out.json]

xgrammar and outlines-core are optional here (`pip install xgrammar outlines-core`); an engine
that is not installed is listed as such, not measured.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "email": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["city"],
        },
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
NAMES = ["Ada", "Grace Hopper", "Linus", "Barbara Liskov", "Edsger", "Ken Thompson", "Frances", "Alan"]
CITIES = ["London", "New York", "Zürich", "Kyoto", "Lagos", "São Paulo"]

Driver = Callable[[list[list[int]]], float]
"""Runs the rows' token lists through fresh matchers; returns the seconds spent."""


def instances(rows: int) -> list[str]:
    out = []
    for i in range(rows):
        # in the schema's property order, which the engines keep
        doc: dict[str, Any] = {"name": NAMES[i % len(NAMES)], "age": 20 + i}
        if i % 2:
            doc["email"] = f"user{i}@example.com"
        doc["tags"] = [f"t{j}" for j in range(i % 4)]
        if i % 3:
            doc["address"] = {"city": CITIES[i % len(CITIES)], "zip": f"{10000 + i}"}
        out.append(json.dumps(doc, ensure_ascii=False))
    return out


def llguidance_driver(hf: Any, vocab: int) -> tuple[float, Driver]:
    import llguidance
    import llguidance.hf
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

    tok = llguidance.hf.from_tokenizer(hf, n_vocab=vocab)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA)
    t0 = time.perf_counter()
    llguidance.LLMatcher(tok, grammar)
    compile_s = time.perf_counter() - t0

    def run(seqs: list[list[int]]) -> float:
        matchers = [llguidance.LLMatcher(tok, grammar) for _ in seqs]
        mask = allocate_token_bitmask(len(seqs), vocab)
        t = time.perf_counter()
        for step in range(max(map(len, seqs))):
            for i, (m, seq) in enumerate(zip(matchers, seqs, strict=True)):
                if step < len(seq):
                    fill_next_token_bitmask(m, mask, i)
                    assert m.consume_token(seq[step]), m.get_error()
        return time.perf_counter() - t

    return compile_s, run


def llguidance_par_driver(hf: Any, vocab: int) -> tuple[float, Driver]:
    """llguidance as the server runs it: every row's mask of a step in one call on its threads."""
    import llguidance
    import llguidance.hf

    tok = llguidance.hf.from_tokenizer(hf, n_vocab=vocab)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA)
    executor = llguidance.LLExecutor()
    words = (vocab + 31) // 32

    def run(seqs: list[list[int]]) -> float:
        matchers = [llguidance.LLMatcher(tok, grammar) for _ in seqs]
        mask = np.zeros((len(seqs), words), dtype=np.uint32)
        t = time.perf_counter()
        for step in range(max(map(len, seqs))):
            live = [(m, i) for i, (m, seq) in enumerate(zip(matchers, seqs, strict=True)) if step < len(seq)]
            executor.unsafe_compute_mask_ptr(live, mask.ctypes.data, words * 4, len(seqs))
            for m, i in live:
                assert m.consume_token(seqs[i][step]), m.get_error()
        return time.perf_counter() - t

    return 0.0, run


def xgrammar_driver(hf: Any, vocab: int) -> tuple[float, Driver]:
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab)
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    t0 = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
    compile_s = time.perf_counter() - t0

    def run(seqs: list[list[int]]) -> float:
        matchers = [xgr.GrammarMatcher(compiled) for _ in seqs]
        mask = xgr.allocate_token_bitmask(len(seqs), vocab)
        t = time.perf_counter()
        for step in range(max(map(len, seqs))):
            for i, (m, seq) in enumerate(zip(matchers, seqs, strict=True)):
                if step < len(seq):
                    m.fill_next_token_bitmask(mask, i)
                    assert m.accept_token(seq[step])
        return time.perf_counter() - t

    return compile_s, run


def outlines_driver(hf: Any, vocab: int) -> tuple[float, Driver]:
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    byte_of = {c: b for b, c in _bytes_to_unicode().items()}
    tokens: dict[bytes, list[int]] = {}
    eos = hf.eos_token_id
    for text, idx in hf.get_vocab().items():
        if idx != eos and idx < vocab:
            raw = bytes(byte_of[c] for c in text) if all(c in byte_of for c in text) else text.encode()
            tokens.setdefault(raw, []).append(idx)
    vocabulary = Vocabulary(eos, tokens)
    regex = build_regex_from_schema(json.dumps(SCHEMA))
    t0 = time.perf_counter()
    index = Index(regex, vocabulary)
    compile_s = time.perf_counter() - t0
    words = (vocab + 31) // 32

    def run(seqs: list[list[int]]) -> float:
        guides = [Guide(index) for _ in seqs]
        mask = np.zeros((len(seqs), words), dtype=np.int32)
        t = time.perf_counter()
        for step in range(max(map(len, seqs))):
            for i, (g, seq) in enumerate(zip(guides, seqs, strict=True)):
                if step < len(seq):
                    g.write_mask_into(mask[i].ctypes.data, words, 4)
                    if step < len(seq) - 1:  # its final state takes no EOS: it is finished
                        g.advance(seq[step], return_tokens=False)
                    else:
                        assert g.is_finished(), "not finished at EOS"
        return time.perf_counter() - t

    return compile_s, run


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: how byte-level BPE vocabularies spell raw bytes."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs), strict=True))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    ap.add_argument("--model", default="smollm2-135m", help="whose tokenizer (a synthetic one where no index is reachable)")
    args = ap.parse_args()

    from transformers import PreTrainedTokenizerFast

    from workers.loading.models import resolve_model

    directory = resolve_model(args.model)
    hf = PreTrainedTokenizerFast.from_pretrained(str(directory))
    vocab = len(hf)
    seqs = [hf.encode(doc, add_special_tokens=False) + [hf.eos_token_id] for doc in instances(args.rows)]
    tokens = sum(len(s) for s in seqs)
    load = os.getloadavg()[0]
    print(f"{args.model}: {args.rows} rows, {tokens} tokens, vocab {vocab}; load average {load:.2f} on "
          f"{os.cpu_count()} cores")
    results: dict[str, Any] = {"rows": args.rows, "tokens": tokens, "load_avg_1m": load, "engines": {}}
    drivers = {"llguidance": llguidance_driver, "llguidance-par": llguidance_par_driver,
               "xgrammar": xgrammar_driver, "outlines-core": outlines_driver}
    print(f"{'engine':<14} {'compile ms':>11} {'us/row-token':>13} {'ms/step of rows':>16}")
    for name, make in drivers.items():
        try:
            compile_s, run = make(hf, vocab)
        except ImportError as e:
            print(f"{name:<14} not installed ({e.name})")
            results["engines"][name] = None
            continue
        try:
            best = min(run(seqs) for _ in range(args.repeats))
        except AssertionError as e:  # an engine that rejects a valid instance is not comparable
            print(f"{name:<14} rejected a valid instance: {e}")
            results["engines"][name] = {"error": str(e)}
            continue
        steps = max(map(len, seqs))
        per_token_us = best / tokens * 1e6
        per_step_ms = best / steps * 1e3
        print(f"{name:<14} {compile_s * 1e3:>11.1f} {per_token_us:>13.1f} {per_step_ms:>16.2f}")
        results["engines"][name] = {"compile_ms": compile_s * 1e3, "us_per_row_token": per_token_us,
                                    "ms_per_step": per_step_ms}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
