"""Grammar libraries side by side (issue 23, point 1): compile time and per-step mask cost.

For each library that imports (llguidance, xgrammar, outlines-core), on the tiny model's
tokenizer: the time to compile the gate's 40 tool-call schemas (each case's tools as one
``anyOf`` of ``{"name": const, "arguments": parameters}``), and the time to compute one token
mask, averaged over a walk of 64 tokens per schema (a random allowed token each step). Install
weight is measured by hand (``du`` of the installed packages and their dependencies) and written
in benchmarks/README.md. Run: ``python benchmarks/grammar_backends.py [--tokenizer DIR]``.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Callable

import numpy as np

from chatfleet.engine.builtin_models.tiny import resolve_model
from chatfleet.engine.tokenizer import ChatTokenizer
from chatfleet.gate.tool_cases import CASES

STEPS = 64


def tool_schema(tools: list[dict]) -> dict:
    return {"anyOf": [{"type": "object", "properties": {
        "name": {"const": t["function"]["name"]},
        "arguments": t["function"].get("parameters") or {"type": "object"}},
        "required": ["name", "arguments"], "additionalProperties": False} for t in tools]}


def byte_vocab(tok: ChatTokenizer) -> list[bytes]:
    return [tok.backend.decode([i], skip_special_tokens=False).encode("utf-8", "surrogatepass")
            for i in range(tok.vocab_size)]


def allowed_from_bits(bits: np.ndarray, vocab: int) -> np.ndarray:
    unpacked = np.unpackbits(bits.view(np.uint8), bitorder="little")[:vocab]
    return np.flatnonzero(unpacked)


def bench_llguidance(tok: ChatTokenizer, schemas: list[dict]) -> dict:
    import llguidance
    import llguidance.numpy as lln

    lltok = llguidance.LLTokenizer(tok.backend.to_str(), n_vocab=tok.vocab_size, eos_token=tok.eos_token_id)
    t0 = time.perf_counter()
    grammars = [llguidance.LLMatcher.grammar_from_json_schema(s, defaults={"whitespace_flexible": False})
                for s in schemas]
    matchers = [llguidance.LLMatcher(lltok, g) for g in grammars]
    compile_s = time.perf_counter() - t0
    assert not any(m.is_error() for m in matchers), [m.get_error() for m in matchers if m.is_error()]
    bits = lln.allocate_token_bitmask(1, tok.vocab_size)

    def step(m) -> np.ndarray:
        lln.fill_next_token_bitmask(m, bits, 0)
        return bits[0]

    return {"compile_s": compile_s, **_walk(matchers, step, lambda m, t: m.consume_token(t),
                                            lambda m: m.is_stopped(), tok.vocab_size)}


def bench_xgrammar(tok: ChatTokenizer, schemas: list[dict]) -> dict:
    import torch
    import xgrammar as xgr

    info = xgr.TokenizerInfo(byte_vocab(tok), vocab_type=xgr.VocabType.RAW, vocab_size=tok.vocab_size,
                             stop_token_ids=[tok.eos_token_id])
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    t0 = time.perf_counter()
    compiled = [compiler.compile_json_schema(json.dumps(s), any_whitespace=False) for s in schemas]
    compile_s = time.perf_counter() - t0
    matchers = [xgr.GrammarMatcher(c) for c in compiled]
    bits = xgr.allocate_token_bitmask(1, tok.vocab_size)

    def step(m) -> np.ndarray:
        m.fill_next_token_bitmask(bits, 0)
        return bits[0].numpy()

    del torch
    return {"compile_s": compile_s, **_walk(matchers, step, lambda m, t: m.accept_token(t),
                                            lambda m: m.is_terminated(), tok.vocab_size)}


def bench_outlines_core(tok: ChatTokenizer, schemas: list[dict]) -> dict:
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    vocab: dict[bytes, list[int]] = {}
    for i, b in enumerate(byte_vocab(tok)):
        if i != tok.eos_token_id and b:
            vocab.setdefault(b, []).append(i)
    vocabulary = Vocabulary(tok.eos_token_id, vocab)
    t0 = time.perf_counter()
    indexes = [Index(build_regex_from_schema(json.dumps(s), whitespace_pattern=""), vocabulary) for s in schemas]
    compile_s = time.perf_counter() - t0
    guides = [Guide(ix) for ix in indexes]

    def step(g) -> np.ndarray:
        allowed = np.zeros(tok.vocab_size, dtype=bool)
        allowed[np.asarray(g.get_tokens(), dtype=np.int64)] = True
        return np.packbits(allowed, bitorder="little").view(np.int32) if tok.vocab_size % 32 == 0 else allowed

    return {"compile_s": compile_s, **_walk(guides, step, lambda g, t: g.advance(t),
                                            lambda g: g.is_finished(), tok.vocab_size)}


def _walk(matchers: list, mask: Callable, consume: Callable, done: Callable, vocab: int) -> dict:
    rng = random.Random(0)
    mask_s, steps = 0.0, 0
    for m in matchers:
        for _ in range(STEPS):
            if done(m):
                break
            t0 = time.perf_counter()
            bits = mask(m)
            mask_s += time.perf_counter() - t0
            steps += 1
            allowed = allowed_from_bits(bits, vocab) if bits.dtype == np.int32 else np.flatnonzero(bits)
            if len(allowed) == 0:
                break
            consume(m, int(rng.choice(list(allowed))))
    return {"mask_us": 1e6 * mask_s / max(steps, 1), "steps": steps}


BACKENDS = {"llguidance": bench_llguidance, "xgrammar": bench_xgrammar, "outlines-core": bench_outlines_core}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", default=None, help="model folder (default: the tiny model)")
    args = ap.parse_args()
    tok = ChatTokenizer.from_pretrained(args.tokenizer or resolve_model("tiny"))
    schemas = [tool_schema(case.tool_specs()) for case in CASES]
    print(f"vocab {tok.vocab_size}, {len(schemas)} schemas")
    print(f"{'library':<14} {'compile 40 (ms)':>16} {'mask (us/step)':>15} {'steps':>6}")
    for name, fn in BACKENDS.items():
        try:
            r = fn(tok, schemas)
        except ImportError as exc:
            print(f"{name:<14} not installed ({exc})")
            continue
        print(f"{name:<14} {1e3 * r['compile_s']:>16.1f} {r['mask_us']:>15.1f} {r['steps']:>6}")


if __name__ == "__main__":
    main()
