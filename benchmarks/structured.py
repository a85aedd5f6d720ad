"""Structured output's cost (issue 23, point 4): step time with 0, 8 and 32 constrained requests in
a batch of 32, and grammar compile time for the gate's 40 tool schemas.

Two parts, both printed as tables and written to benchmarks/results/structured.json:

- ``engine``: in process, the real model (``--model``, float32, ``--threads``): 32 requests decode
  together; k of them carry a JSON schema (an object holding a list of strings, which a random-
  weight model keeps open, so all k stay constrained through the measured steps). Median
  ``Engine.step()`` wall time over ``--steps`` decode steps, and the share spent filling the
  batch's bitmask. Then compile time of the 40 tool-call grammars (``tool_choice: required`` in
  the qwen3 format, and the plain JSON schema of a call) on a cold compiler.
- ``http``: each backend of ``--only`` (ours, vllm) serves the same model; 32 concurrent streams,
  k with ``response_format: json_schema``; median inter-token gap of the streams; then each of the
  40 tool schemas once as a ``response_format`` with ``max_tokens: 1``: its time to first token
  minus an unconstrained request's (the server's compile plus first mask).

    python benchmarks/structured.py --model tiny --threads 2
    python benchmarks/structured.py --part http --only ours,vllm
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from backends import BACKENDS, SERVED_NAME, select_backends  # noqa: E402
from chatfleet.engine.api.tool_parsers import TOOL_PARSERS  # noqa: E402
from chatfleet.engine.builtin_models.tiny import resolve_model  # noqa: E402
from chatfleet.engine.config import CacheConfig, EngineConfig, SchedulerConfig  # noqa: E402
from chatfleet.engine.engine import Engine  # noqa: E402
from chatfleet.engine.models.loader import load_model  # noqa: E402
from chatfleet.engine.request import SamplingParams  # noqa: E402
from chatfleet.engine.runner.torch_runner import TorchRunner  # noqa: E402
from chatfleet.engine.structured.compiler import GrammarCompiler  # noqa: E402
from chatfleet.engine.structured.spec import GrammarSpec  # noqa: E402
from chatfleet.gate.tool_cases import CASES  # noqa: E402
from common import RESULTS_DIR, ServerProcess  # noqa: E402

BATCH = 32
CONSTRAINED = (0, 8, 32)
BS = 16
NOTES = {"type": "object", "properties": {"notes": {"type": "array", "items": {"type": "string"}}},
         "required": ["notes"], "additionalProperties": False}


def call_schema(tools: list[dict]) -> dict:
    return {"anyOf": [{"type": "object", "properties": {
        "name": {"const": t["function"]["name"]},
        "arguments": t["function"].get("parameters") or {"type": "object"}},
        "required": ["name", "arguments"], "additionalProperties": False} for t in tools]}


# ---------------------------------------------------------------- in process


def engine_steps(loaded, constrained: int, steps: int, prompt: list[int]) -> dict:
    blocks = BATCH * (-(-(len(prompt) + steps + 40) // BS))
    config = EngineConfig(model="bench", max_model_len=4096, cache=CacheConfig(
        block_size=BS, num_tokens=blocks * BS, enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_batched_tokens=4096, max_running=BATCH))
    engine = Engine(config, runner=TorchRunner(loaded, blocks, BS), tokenizer=loaded.tokenizer)
    n = steps + 20
    for i in range(BATCH):
        grammar = GrammarSpec.json_schema(NOTES) if i < constrained else None
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=n, min_tokens=n, temperature=1.0, seed=i,
                                                           grammar=grammar))
    structured = engine.structured
    assert structured is not None
    fill_s = 0.0
    original = structured.bitmask

    def timed_bitmask(ids):
        nonlocal fill_s
        t0 = time.perf_counter()
        out = original(ids)
        fill_s += time.perf_counter() - t0
        return out

    structured.bitmask = timed_bitmask  # type: ignore[method-assign]
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.requests.values()):
        engine.step()
    for _ in range(5):  # warm-up decode steps
        engine.step()
    fill_s = 0.0
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    assert len(structured) == constrained, "a constrained request left its grammar"
    return {"constrained": constrained, "step_ms": 1e3 * statistics.median(times),
            "mask_fill_ms": 1e3 * fill_s / steps}


def compile_times(tokenizer) -> dict:
    out = {}
    parser = TOOL_PARSERS.make("qwen3")
    kinds = {
        "tool_choice required (lark, qwen3 format)": lambda c: parser.grammar(
            [(t["function"]["name"], t["function"].get("parameters")) for t in c.tool_specs()], True),
        "response_format json_schema (a call object)": lambda c: GrammarSpec.json_schema(call_schema(c.tool_specs())),
    }
    for label, make in kinds.items():
        compiler = GrammarCompiler(tokenizer.backend.to_str(), tokenizer.vocab_size, tokenizer.eos_token_id)
        compiler.tokenizer  # the tokenizer's one-time cost, outside the per-schema times  # noqa: B018
        per = []
        for case in CASES:
            t0 = time.perf_counter()
            compiler.compile(make(case))
            per.append(time.perf_counter() - t0)
        out[label] = {"total_ms": 1e3 * sum(per), "median_ms": 1e3 * statistics.median(per),
                      "max_ms": 1e3 * max(per), "distinct": compiler.num_compiled}
        compiler.close()
    return out


def run_engine(args) -> dict:
    torch.set_num_threads(args.threads)
    loaded = load_model(resolve_model(args.model), dtype="float32")
    prompt = loaded.tokenizer.encode("Write the ship's log as JSON. " * 8)
    rows = [engine_steps(loaded, k, args.steps, prompt) for k in CONSTRAINED]
    base = rows[0]["step_ms"]
    print(f"engine, {args.model}, batch {BATCH}, {args.threads} threads, {args.steps} steps")
    print(f"{'constrained':>11} {'step ms':>9} {'vs 0':>7} {'mask fill ms':>13}")
    for r in rows:
        r["vs_unconstrained"] = r["step_ms"] / base
        print(f"{r['constrained']:>11} {r['step_ms']:>9.2f} {r['vs_unconstrained']:>6.2f}x {r['mask_fill_ms']:>13.3f}")
    compiled = compile_times(loaded.tokenizer)
    print("compile, 40 gate tool schemas, cold cache:")
    for label, c in compiled.items():
        print(f"  {label}: total {c['total_ms']:.1f} ms, median {c['median_ms']:.2f} ms, max {c['max_ms']:.2f} ms"
              f" ({c['distinct']} distinct grammars)")
    return {"steps": rows, "compile": compiled}


# ---------------------------------------------------------------- over HTTP


async def _stream(client: httpx.AsyncClient, url: str, body: dict) -> list[float]:
    arrivals = []
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                    arrivals.append(time.perf_counter())
    return arrivals


def _body(model: str, i: int, constrained: bool, n: int) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": f"Ship's log {i}, as JSON."}],
            "max_tokens": n, "min_tokens": n, "temperature": 1.0, "seed": i, "stream": True}
    if constrained:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "log", "schema": NOTES}}
    else:
        body["ignore_eos"] = True
    return body


async def http_part(url: str, model: str, steps: int) -> dict:
    out: dict = {"gaps": [], "compile": {}}
    async with httpx.AsyncClient(timeout=600) as client:
        await _stream(client, url, _body(model, 0, True, 4))  # warm-up
        for k in CONSTRAINED:
            runs = await asyncio.gather(*(_stream(client, url, _body(model, i, i < k, steps)) for i in range(BATCH)))
            gaps = [b - a for arr in runs for a, b in zip(arr[2:], arr[3:], strict=False)]
            out["gaps"].append({"constrained": k, "median_gap_ms": 1e3 * statistics.median(gaps)})

        async def ttft(body: dict) -> float:
            t0 = time.perf_counter()
            r = await client.post(url + "/v1/chat/completions", json=body)
            r.raise_for_status()
            return time.perf_counter() - t0

        plain = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "temperature": 0}
        for _ in range(3):
            await ttft(plain)
        bases, extra = [], []
        for case in CASES:  # each schema's first request beside a plain one just before it
            fmt = {"type": "json_schema", "json_schema": {"name": "call", "schema": call_schema(case.tool_specs())}}
            base = await ttft(plain)
            bases.append(base)
            extra.append(await ttft({**plain, "response_format": fmt}) - base)
        out["compile"] = {"plain_ttft_ms": 1e3 * statistics.median(bases), "extra_total_ms": 1e3 * sum(extra),
                          "extra_median_ms": 1e3 * statistics.median(extra)}
    return out


def run_http(args) -> dict:
    model_dir = resolve_model(args.model)
    results = {}
    for i, backend in enumerate(select_backends(args.only)):
        if not backend.installed():
            print(f"{backend.label}: not installed ({backend.install_hint})")
            results[backend.name] = {"skipped": "not installed"}
            continue
        port = 8950 + i
        spec = backend.launch(model_dir, port, args.threads, 256 << 20, 4096)
        log = RESULTS_DIR / "logs" / f"structured_{backend.name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with ServerProcess(backend.name, spec.argv, port, spec.env, log) as server:
            server.wait_healthy()
            r = asyncio.run(http_part(server.base_url, spec.request_model or SERVED_NAME, args.steps))
        results[backend.name] = r
        base = r["gaps"][0]["median_gap_ms"]
        print(f"{backend.label}: median inter-token gap, {BATCH} streams")
        for g in r["gaps"]:
            ratio = g["median_gap_ms"] / base
            print(f"  {g['constrained']:>2} constrained: {g['median_gap_ms']:.2f} ms ({ratio:.2f}x)")
        c = r["compile"]
        print(f"  40 tool schemas as response_format: +{c['extra_total_ms']:.0f} ms in all, median"
              f" +{c['extra_median_ms']:.1f} ms over a plain request's {c['plain_ttft_ms']:.1f} ms")
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--part", choices=("engine", "http", "both"), default="both")
    ap.add_argument("--only", default="ours,vllm", help=f"http backends, of {', '.join(BACKENDS)}")
    args = ap.parse_args()
    out: dict = {"model": args.model, "threads": args.threads, "batch": BATCH}
    if args.part in ("engine", "both"):
        out["engine"] = run_engine(args)
    if args.part in ("http", "both"):
        out["http"] = run_http(args)
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    (RESULTS_DIR / "structured.json").write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
