"""Greedy equivalence on the real tiny model, in float32 and (where the CPU has it natively) in
bfloat16: a request's greedy output is the same alone or batched, chunked or not, with a
prefix-cache hit or cold, and after preemption.

Every test runs on both attention paths of the runner: ``gather`` (the CPU's own; its decodes
through the C++ kernel where it builds, and as ``gather:torch`` through torch ops) and
``kernels`` (block tables built once per step and the dispatched kernels, which on the CPU run
their torch references: the wiring a GPU runs with Triton; float32 only here). ``test_cuda_equivalence.py`` runs
the same family on a GPU."""

import pytest
import torch

from chatfleet.engine.builtin_models.tiny import resolve_model
from chatfleet.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from chatfleet.engine.engine import Engine
from chatfleet.engine.models import paged_decode_cpu
from chatfleet.engine.models.dtype import native_bf16
from chatfleet.engine.models.loader import load_model
from chatfleet.engine.request import SamplingParams
from chatfleet.engine.runner.torch_runner import TorchRunner

BS = 16
MAX_LEN = 1024
SYSTEM = "You are Captain Mara, a weathered sky-pirate who speaks in short, salty sentences."
USERS = [
    "Where are we headed tonight?",
    "¿Cuántas monedas quedan en el cofre?",
    "Расскажи мне о своём корабле, капитан, и о том, как ты его нашла.",
    "船の名前は何ですか？",
    "Tell me a long story about the storm over the glass sea, with every detail you remember.",
]


DTYPES = ["float32", pytest.param("bfloat16", marks=pytest.mark.skipif(
    not native_bf16(torch.device("cpu")), reason="the CPU emulates bfloat16"))]


@pytest.fixture(scope="module", params=DTYPES)
def loaded(request):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield load_model(resolve_model("tiny"), dtype=request.param)
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def prompts(loaded):
    tok = loaded.tokenizer
    return [tok.encode_chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": u}]) for u in USERS]


@pytest.fixture(scope="module", params=["gather", "gather:torch", "kernels"])
def attention(request, loaded):
    if request.param == "kernels" and loaded.dtype != torch.float32:
        # The kernels path's CPU references attend through SDPA, whose bfloat16 blocking follows
        # the query length: chunked and whole prefills round differently. The GPU runs this
        # path's bfloat16 equivalence with its own kernels (test_cuda_equivalence.py).
        pytest.skip("bfloat16 runs the CPU's own attention path here")
    return request.param


def make_engine(loaded, num_blocks=128, prefix=True, num_host_blocks=0, attention="gather", **sched):
    config = EngineConfig(
        model="tiny",
        max_model_len=MAX_LEN,
        cache=CacheConfig(block_size=BS, num_tokens=num_blocks * BS, enable_prefix_caching=prefix),
        scheduler=SchedulerConfig(**sched),
    )
    path, _, decode_kernel = attention.partition(":")
    runner = TorchRunner(loaded, num_blocks, BS, num_host_blocks=num_host_blocks, attention=path,
                         decode_kernel=decode_kernel or "auto")
    assert runner.attention == path
    if decode_kernel:
        assert runner.decode_kernel == decode_kernel
    elif path == "gather" and paged_decode_cpu.available():
        assert runner.decode_kernel == "cpp"  # the tiny model's decodes run the C++ kernel
    return Engine(config, runner=runner, tokenizer=loaded.tokenizer)


PARAMS = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def run(engine, requests, stagger=0):
    """Add ``requests`` (id -> prompt), ``stagger`` steps apart; drain; return id -> tokens."""
    tokens = {rid: [] for rid in requests}
    cached = {}
    pending = list(requests.items())
    while pending or engine.has_unfinished_requests():
        if pending:
            rid, prompt = pending.pop(0)
            engine.add_request(rid, prompt, PARAMS)
            for _ in range(stagger):
                for o in engine.step():
                    tokens[o.request_id] += o.new_token_ids
                    cached[o.request_id] = o.num_cached_tokens
                engine.check_integrity()
            continue
        for o in engine.step():
            tokens[o.request_id] += o.new_token_ids
            cached[o.request_id] = o.num_cached_tokens
        engine.check_integrity()
    engine.check_integrity()
    assert all(b.ref_cnt == 0 for b in engine.kv.pool.blocks)
    run.cached = cached
    return tokens


@pytest.fixture(scope="module")
def alone(loaded, prompts, attention):
    out = {}
    for i, p in enumerate(prompts):
        out[f"r{i}"] = run(make_engine(loaded, prefix=False, attention=attention), {f"r{i}": p})[f"r{i}"]
        assert len(out[f"r{i}"]) == PARAMS.max_tokens
    assert len({tuple(t) for t in out.values()}) > 1, "the tiny model answers everything alike"
    return out


def test_batched_equals_alone(loaded, prompts, alone, attention):
    engine = make_engine(loaded, prefix=False, attention=attention)
    got = run(engine, {f"r{i}": p for i, p in enumerate(prompts)}, stagger=2)
    assert got == alone


def test_chunked_prefill_equals_unchunked(loaded, prompts, alone, attention):
    engine = make_engine(loaded, prefix=False, max_batched_tokens=7, attention=attention)
    got = run(engine, {f"r{i}": p for i, p in enumerate(prompts)})
    assert got == alone


def test_mixed_step_budget_equals_alone(loaded, prompts, alone, attention):
    # prompts joining two steps apart are cut to the 6 tokens a step has beside the decodes
    engine = make_engine(loaded, prefix=False, mixed_step_tokens=6, attention=attention)
    got = run(engine, {f"r{i}": p for i, p in enumerate(prompts)}, stagger=2)
    assert got == alone


def test_prefix_cache_hit_equals_cold(loaded, prompts, alone, attention):
    engine = make_engine(loaded, attention=attention)
    run(engine, {"warm": prompts[0]})
    got = run(engine, {f"r{i}": p for i, p in enumerate(prompts)})
    assert got == alone
    assert run.cached["r0"] == (len(prompts[0]) - 1) // BS * BS  # all but the last token's block
    assert all(run.cached[f"r{i}"] > 0 for i in range(1, len(prompts)))  # the shared system prompt
    assert engine.stats().prefix_cache_hits > 0


def test_host_tier_reload_equals_cold(loaded, prompts, alone, attention):
    longest = max(len(p) for p in prompts) + PARAMS.max_tokens
    engine = make_engine(loaded, num_blocks=-(-longest // BS) + 1, num_host_blocks=64, attention=attention)
    run(engine, {f"r{i}": p for i, p in enumerate(prompts)})  # each evicts the one before
    assert engine.stats().host_demotions > 0
    got = run(engine, {"r0": prompts[0], "r4": prompts[4]})
    stats = engine.stats()
    assert stats.host_promotions > 0 and stats.host_cache_hits > 0, stats
    assert got == {"r0": alone["r0"], "r4": alone["r4"]}
    assert all(b.ref_cnt == 0 for b in engine.kv.host_pool.blocks)


def test_preempted_equals_alone(loaded, prompts, alone, attention):
    longest = max(len(p) for p in prompts) + PARAMS.max_tokens
    engine = make_engine(loaded, num_blocks=-(-longest // BS) + 1, prefix=False, max_batched_tokens=24,
                         attention=attention)
    got = run(engine, {f"r{i}": p for i, p in enumerate(prompts)})
    assert engine.stats().num_preemptions > 0, engine.stats()
    assert got == alone


def test_prompt_logprobs_chunked_match_unchunked(loaded, prompts, attention):
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=2)

    def score(**sched):
        engine = make_engine(loaded, attention=attention, **sched)
        engine.add_request("s", prompts[4], params)
        outs = []
        while engine.has_unfinished_requests():
            outs += engine.step()
        return outs[0].prompt_logprobs

    whole, chunked = score(), score(max_batched_tokens=5)
    assert len(whole) == len(prompts[4]) and whole[0] is None
    assert [lp.token_id for lp in whole[1:]] == prompts[4][1:]
    for a, b in zip(whole[1:], chunked[1:], strict=True):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)


def _decode_kernel(attention):
    """The config's decode kernel for an ``attention`` param (``gather:torch``: torch ops)."""
    return attention.partition(":")[2] or "auto"


def test_engine_built_from_config_loads_sizes_and_matches(loaded, prompts, alone, attention):
    from chatfleet.engine.runner.torch_runner import kv_bytes_per_token

    dtype = str(loaded.dtype).removeprefix("torch.")
    per_token = kv_bytes_per_token(loaded.config, dtype)
    config = EngineConfig(model="tiny", num_threads=1, dtype=dtype, decode_kernel=_decode_kernel(attention),
                          cache=CacheConfig(block_size=BS, memory_bytes=per_token * BS * 40))
    engine = Engine(config)
    assert engine.kv.num_blocks == 40 and engine.max_model_len == 40 * BS  # capped by the pool
    assert engine.model_name == "tiny" and engine.vocab_size == loaded.config.vocab_size
    assert run(engine, {"r1": prompts[1]}) == {"r1": alone["r1"]}


def test_host_cache_memory_sizes_the_host_pool_from_the_kv_spec(loaded, prompts, alone, attention):
    from chatfleet.engine.runner.torch_runner import kv_bytes_per_token

    dtype = str(loaded.dtype).removeprefix("torch.")
    per_token = kv_bytes_per_token(loaded.config, dtype)
    cache = CacheConfig(block_size=BS, num_tokens=40 * BS, host_memory_bytes=per_token * BS * 24)
    engine = Engine(EngineConfig(model="tiny", num_threads=1, dtype=dtype, cache=cache,
                                 decode_kernel=_decode_kernel(attention)))
    assert engine.kv.host_pool.num_blocks == 24 and engine.runner.num_host_blocks == 24
    assert run(engine, {"r2": prompts[2]}) == {"r2": alone["r2"]}
