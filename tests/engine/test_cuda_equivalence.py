"""The engine's greedy equivalence family on a GPU: batching, chunked prefill, a prefix hit, a
host-tier reload under concurrency and preemption give a request the output it gets alone, with
CUDA graphs on and off (and the same tokens either way), and with FP8 weights + FP8 KV. The
runner takes the GPU path here: the kernels attention path with Triton, host copies on their own
stream, decode steps replayed from graphs. Skipped, with the reason, where there is no GPU; the
CPU runs the same family over the same wiring in test_greedy_equivalence.py."""

import pytest
import torch

from chatfleet.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from chatfleet.engine.engine import Engine
from chatfleet.engine.request import SamplingParams
from chatfleet.engine.runner.torch_runner import TorchRunner

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device: the engine's equivalence family runs on a GPU "
    "(benchmarks/gpu_check.sh); the CPU runs it over the references in test_greedy_equivalence.py")]

BS = 16
SYSTEM = "You are Captain Mara, a weathered sky-pirate who speaks in short, salty sentences."
USERS = ["Where are we headed tonight?", "¿Cuántas monedas quedan en el cofre?",
         "Расскажи мне о своём корабле, капитан, и о том, как ты его нашла.", "船の名前は何ですか？",
         "Tell me a long story about the storm over the glass sea, with every detail you remember."]
PARAMS = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
# name -> (dtype, quantization, kv cache dtype, enforce_eager)
SETUPS = {"fp32-graphs": ("float32", None, "auto", False), "fp32-eager": ("float32", None, "auto", True),
          "fp8-graphs": ("bfloat16", "fp8", "fp8", False)}


@pytest.fixture(scope="module", params=list(SETUPS))
def setup(request):
    from chatfleet.engine.builtin_models.tiny import resolve_model
    from chatfleet.engine.models.loader import load_model

    dtype, quantization, kv, eager = SETUPS[request.param]
    loaded = load_model(resolve_model("tiny"), dtype=dtype, device="cuda", quantization=quantization)
    return request.param, loaded, kv, eager


@pytest.fixture(scope="module")
def prompts(setup):
    tok = setup[1].tokenizer
    return [tok.encode_chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": u}]) for u in USERS]


def make_engine(setup, num_blocks=128, prefix=True, num_host_blocks=0, **sched):
    _, loaded, kv, eager = setup
    config = EngineConfig(model="tiny", max_model_len=1024, device="cuda", kv_cache_dtype=kv, enforce_eager=eager,
                          cache=CacheConfig(block_size=BS, num_tokens=num_blocks * BS, enable_prefix_caching=prefix),
                          scheduler=SchedulerConfig(**sched))
    runner = TorchRunner(loaded, num_blocks, BS, device="cuda", num_host_blocks=num_host_blocks, kv_cache_dtype=kv,
                         enforce_eager=eager)
    assert runner.attention == "kernels" and (runner.graphs is None) == eager
    return Engine(config, runner=runner, tokenizer=loaded.tokenizer)


def run(engine, requests, stagger=0):
    tokens = {rid: [] for rid in requests}
    pending = list(requests.items())
    while pending or engine.has_unfinished_requests():
        if pending:
            rid, prompt = pending.pop(0)
            engine.add_request(rid, prompt, PARAMS)
            steps = stagger
        else:
            steps = 1
        for _ in range(steps):
            for o in engine.step():
                tokens[o.request_id] += o.new_token_ids
            engine.check_integrity()
    assert all(b.ref_cnt == 0 for b in engine.kv.pool.blocks)
    return tokens


_ALONE: dict[str, dict[str, list[int]]] = {}


@pytest.fixture(scope="module")
def alone(setup, prompts):
    out = {f"r{i}": run(make_engine(setup, prefix=False), {f"r{i}": p})[f"r{i}"] for i, p in enumerate(prompts)}
    assert len({tuple(t) for t in out.values()}) > 1
    _ALONE[setup[0]] = out
    return out


def test_batched_equals_alone(setup, prompts, alone):
    engine = make_engine(setup, prefix=False)
    assert run(engine, {f"r{i}": p for i, p in enumerate(prompts)}, stagger=2) == alone
    if engine.runner.graphs is not None:
        assert engine.runner.graphs.replays > 0 and engine.runner.graphs.captured


def test_chunked_prefill_equals_unchunked(setup, prompts, alone):
    assert run(make_engine(setup, prefix=False, max_batched_tokens=7), dict(zip(alone, prompts, strict=True))) == alone


def test_prefix_cache_hit_equals_cold(setup, prompts, alone):
    engine = make_engine(setup)
    run(engine, {"warm": prompts[0]})
    assert run(engine, dict(zip(alone, prompts, strict=True))) == alone
    assert engine.stats().prefix_cache_hits > 0


def test_host_tier_reload_under_concurrency_equals_cold(setup, prompts, alone):
    longest = max(len(p) for p in prompts) + PARAMS.max_tokens
    engine = make_engine(setup, num_blocks=-(-longest // BS) * 2 + 1, num_host_blocks=64)
    run(engine, dict(zip(alone, prompts, strict=True)))
    got = run(engine, {"r0": prompts[0], "r4": prompts[4], "r2": prompts[2]})
    stats = engine.stats()
    assert stats.host_demotions > 0 and stats.host_promotions > 0, stats
    assert got == {k: alone[k] for k in ("r0", "r4", "r2")}


def test_preempted_equals_alone(setup, prompts, alone):
    longest = max(len(p) for p in prompts) + PARAMS.max_tokens
    engine = make_engine(setup, num_blocks=-(-longest // BS) + 1, prefix=False, max_batched_tokens=24)
    assert run(engine, dict(zip(alone, prompts, strict=True))) == alone
    assert engine.stats().num_preemptions > 0


def test_graphs_on_and_off_give_the_same_tokens(setup, alone):
    if "fp32-graphs" in _ALONE and "fp32-eager" in _ALONE:
        assert _ALONE["fp32-graphs"] == _ALONE["fp32-eager"]
    else:
        pytest.skip("needs both fp32 setups (runs once both have)")
