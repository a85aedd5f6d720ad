"""Accuracy of each FP8 option against the same model in 32 bits (tiny and small).

For each model: the 32-bit engine writes greedy replies to the first turns of role-play
conversations (``chatfleet.bench`` workload ``cpu-roleplay``); then every option scores the
same token sequences (prompt + reply) by chunked prefill through its own paged KV cache
(chunks of 48 tokens, so later chunks read earlier keys and values back from the cache, FP8
where the option says so). Reported per option:

- logits vs 32 bits over every position: max and mean absolute difference, top-1 agreement;
- mean per-token NLL of the 32-bit model's own greedy replies, and its difference to the 32-bit
  model's, beside the stated bound of 0.02 nats per token.

Options: bf16 (for scale), FP8 KV with scale 1.0, FP8 KV with scales from the prompts, FP8
weights (block-wise [128,128], quantized at load), FP8 embedding (per-row), and all FP8 at once.

    PYTHONPATH=src python benchmarks/fp8_accuracy.py [--models tiny small] [--conversations 6]
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass

import torch

from chatfleet.bench.tokens import HFTokenCounter
from chatfleet.bench.workload import Workload, get_profile
from chatfleet.engine.builtin_models.tiny import resolve_model
from chatfleet.engine.config import CacheConfig, EngineConfig
from chatfleet.engine.engine import Engine
from chatfleet.engine.models.attention import KVCache, build_attention_metadata
from chatfleet.engine.models.kv_cache import FP8
from chatfleet.engine.models.kv_calibration import measure_kv_scales
from chatfleet.engine.models.kv_scales import KVScales
from chatfleet.engine.models.loader import load_model
from chatfleet.engine.request import SamplingParams

try:
    from common import RESULTS_DIR
except ImportError:  # run from elsewhere
    from benchmarks.common import RESULTS_DIR

NLL_BOUND = 0.02  # nats per token
CHUNK = 48
BLOCK = 16


@dataclass(frozen=True)
class Option:
    name: str
    dtype: str = "float32"
    kv: str = "auto"  # auto | fp8
    kv_scales: str = "default"  # default (1.0) | prompts
    quantization: str | None = None
    embedding_dtype: str = "auto"


OPTIONS = (
    Option("fp32"),
    Option("bf16", dtype="bfloat16"),
    Option("fp8-kv (scale 1.0)", kv="fp8"),
    Option("fp8-kv (prompt scales)", kv="fp8", kv_scales="prompts"),
    Option("fp8-weights", quantization="fp8"),
    Option("fp8-embedding", embedding_dtype="fp8"),
    Option("all fp8", kv="fp8", kv_scales="prompts", quantization="fp8", embedding_dtype="fp8"),
)


def greedy_sequences(model: str, conversations: int, reply_tokens: int) -> tuple[list[list[int]], list[int]]:
    """(prompt + 32-bit greedy reply) token sequences, and where each reply starts."""
    engine = Engine(EngineConfig(model=model, cache=CacheConfig(num_tokens=16384)))
    folder = resolve_model(model)
    workload = Workload(get_profile("cpu-roleplay"), seed=0, counter=HFTokenCounter(folder / "tokenizer.json"))
    params = SamplingParams(max_tokens=reply_tokens, temperature=0.0, ignore_eos=True)
    prompts = {}
    for i in range(conversations):
        prompts[f"c{i}"] = engine.tokenizer.encode_chat(workload.conversation(i).messages(0))
        engine.add_request(f"c{i}", prompts[f"c{i}"], params)
    replies = {rid: [] for rid in prompts}
    while engine.has_unfinished_requests():
        for out in engine.step():
            replies[out.request_id] += out.new_token_ids
    return [prompts[r] + replies[r] for r in prompts], [len(prompts[r]) for r in prompts]


def paged_logits(loaded, tokens: list[int], kv_dtype: torch.dtype, scales: KVScales) -> torch.Tensor:
    """Logits [T, V] of one sequence by chunked prefill through a fresh paged cache."""
    cfg = loaded.config
    num_blocks = -(-len(tokens) // BLOCK)
    caches = [KVCache.allocate(num_blocks, BLOCK, cfg.num_kv_heads, cfg.head_dim, kv_dtype, "cpu",
                               scales.k[i], scales.v[i]) for i in range(cfg.num_layers)]
    table = list(range(num_blocks))
    out = []
    with torch.inference_mode():
        for start in range(0, len(tokens), CHUNK):
            n = min(CHUNK, len(tokens) - start)
            meta = build_attention_metadata(BLOCK, [], [], [start], [n], [table], "cpu")
            hidden = loaded.model(torch.tensor(tokens[start:start + n]), torch.arange(start, start + n), meta, caches)
            out.append(loaded.model.compute_logits(hidden))
    return torch.cat(out)


def evaluate(model: str, option: Option, seqs: list[list[int]], reply_starts: list[int]) -> dict:
    loaded = load_model(resolve_model(model), dtype=option.dtype, kernels="torch", quantization=option.quantization,
                        embedding_dtype=option.embedding_dtype)
    n_layers = loaded.config.num_layers
    if option.kv == "fp8":
        scales = (measure_kv_scales(loaded.model, [s[:rs] for s, rs in zip(seqs, reply_starts, strict=True)], 2048,
                                    torch.device("cpu"))
                  if option.kv_scales == "prompts" else KVScales.ones(n_layers))
        kv_dtype = FP8
    else:
        scales, kv_dtype = KVScales.ones(n_layers), loaded.dtype
    logits, nll, n_reply = [], 0.0, 0
    for seq, rs in zip(seqs, reply_starts, strict=True):
        lg = paged_logits(loaded, seq, kv_dtype, scales).float()
        logits.append(lg)
        lp = lg[rs - 1 : len(seq) - 1].log_softmax(-1)
        nll -= float(lp.gather(1, torch.tensor(seq[rs:])[:, None]).sum())
        n_reply += len(seq) - rs
    return {"logits": torch.cat(logits), "nll": nll / n_reply, "reply_tokens": n_reply,
            "kv_scales": [round(min(scales.k), 5), round(max(scales.k), 5)]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["tiny", "small"])
    ap.add_argument("--conversations", type=int, default=6)
    ap.add_argument("--reply-tokens", type=int, default=40)
    args = ap.parse_args()
    torch.set_num_threads(1)
    results = {}
    for model in args.models:
        start = time.perf_counter()
        seqs, reply_starts = greedy_sequences(model, args.conversations, args.reply_tokens)
        ref = evaluate(model, OPTIONS[0], seqs, reply_starts)
        rows = []
        for option in OPTIONS:
            got = ref if option is OPTIONS[0] else evaluate(model, option, seqs, reply_starts)
            diff = (got["logits"] - ref["logits"]).abs()
            rows.append({
                "option": option.name,
                "positions": diff.shape[0],
                "max_abs_diff": float(diff.max()),
                "mean_abs_diff": float(diff.mean()),
                "top1_agreement": float((got["logits"].argmax(-1) == ref["logits"].argmax(-1)).float().mean()),
                "nll_per_token": got["nll"],
                "nll_delta": got["nll"] - ref["nll"],
                "within_bound": abs(got["nll"] - ref["nll"]) <= NLL_BOUND,
                "kv_scales_k_range": got["kv_scales"],
            })
        results[model] = {"rows": rows, "reply_tokens": ref["reply_tokens"], "seconds": time.perf_counter() - start}
        print(f"\n{model}: {rows[0]['positions']} positions, {ref['reply_tokens']} reply tokens of"
              f" {len(seqs)} role-play conversations (NLL bound {NLL_BOUND} nats/token)")
        print(f"  {'option':<24}{'max|d|':>9}{'mean|d|':>10}{'top-1':>8}{'NLL':>9}{'dNLL':>9}  within")
        for r in rows:
            print(f"  {r['option']:<24}{r['max_abs_diff']:>9.4f}{r['mean_abs_diff']:>10.5f}"
                  f"{r['top1_agreement']:>8.3f}{r['nll_per_token']:>9.4f}{r['nll_delta']:>+9.4f}"
                  f"  {'yes' if r['within_bound'] else 'NO'}")
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / "fp8_accuracy.json"
    path.write_text(json.dumps({"nll_bound": NLL_BOUND, "chunk": CHUNK, "models": results}, indent=2))
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
