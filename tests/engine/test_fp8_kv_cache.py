"""The FP8 KV cache in the engine: greedy equivalence (alone, batched, chunked, prefix hit,
preempted), KV scales from the checkpoint / defaulted with one warning / measured from prompts,
and the pool it buys at the same memory."""

from __future__ import annotations

import logging
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from chatfleet.engine.builtin_models.tiny import resolve_model
from chatfleet.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from chatfleet.engine.engine import Engine
from chatfleet.engine.models.kv_cache import FP8
from chatfleet.engine.models.kv_scales import MISSING_SCALES_WARNING, match_kv_scale
from chatfleet.engine.models.loader import load_model
from chatfleet.engine.request import SamplingParams
from chatfleet.engine.runner.torch_runner import TorchRunner
from chatfleet.errors import ConfigError

BS = 16
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
USERS = ["Where are we headed tonight?", "¿Cuántas monedas quedan en el cofre?",
         "Tell me a long story about the storm over the glass sea, with every detail you remember."]
SYSTEM = "You are Captain Mara, a weathered sky-pirate who speaks in short, salty sentences."


@pytest.fixture(scope="module")
def scaled_folder(tmp_path_factory):
    """The tiny model plus per-layer KV scales under the names vLLM reads."""
    dst = tmp_path_factory.mktemp("kvscales") / "tiny-kv"
    shutil.copytree(resolve_model("tiny"), dst)
    tensors = load_file(dst / "model.safetensors")
    for i in range(4):
        tensors[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(0.02 + 0.001 * i)
        tensors[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(0.03)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def loaded(scaled_folder):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield load_model(scaled_folder)
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def prompts(loaded):
    tok = loaded.tokenizer
    return [tok.encode_chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": u}]) for u in USERS]


def make_engine(loaded, num_blocks=96, prefix=True, num_host_blocks=0, decode_kernel="auto", **sched):
    config = EngineConfig(model="tiny", max_model_len=1024, kv_cache_dtype="fp8",
                          cache=CacheConfig(block_size=BS, num_tokens=num_blocks * BS, enable_prefix_caching=prefix),
                          scheduler=SchedulerConfig(**sched))
    runner = TorchRunner(loaded, num_blocks, BS, num_host_blocks=num_host_blocks, kv_cache_dtype="fp8",
                         decode_kernel=decode_kernel)
    return Engine(config, runner=runner, tokenizer=loaded.tokenizer)


def run(engine, requests):
    tokens = {rid: [] for rid in requests}
    for rid, prompt in requests.items():
        engine.add_request(rid, prompt, PARAMS)
    while engine.has_unfinished_requests():
        for o in engine.step():
            tokens[o.request_id] += o.new_token_ids
        engine.check_integrity()
    assert all(b.ref_cnt == 0 for b in engine.kv.pool.blocks)
    return tokens


@pytest.fixture(scope="module")
def alone(loaded, prompts):
    out = {f"r{i}": run(make_engine(loaded, prefix=False), {f"r{i}": p})[f"r{i}"] for i, p in enumerate(prompts)}
    assert len({tuple(t) for t in out.values()}) > 1
    return out


def test_cache_is_fp8_with_the_checkpoint_scales(loaded):
    runner = make_engine(loaded).runner
    assert all(c.key.dtype == FP8 and c.value.dtype == FP8 for c in runner.kv_caches)
    assert [c.k_scale for c in runner.kv_caches] == pytest.approx([0.02, 0.021, 0.022, 0.023])
    assert runner.kv_scales.source == "checkpoint"


def test_batched_chunked_prefix_hit_and_preempted_equal_alone(loaded, prompts, alone):
    everyone = {f"r{i}": p for i, p in enumerate(prompts)}
    assert run(make_engine(loaded, prefix=False), everyone) == alone
    assert run(make_engine(loaded, prefix=False, max_batched_tokens=7), everyone) == alone
    warm = make_engine(loaded)
    run(warm, {"warm": prompts[0]})
    assert run(warm, everyone) == alone
    assert warm.stats().prefix_cache_hits > 0
    longest = max(len(p) for p in prompts) + PARAMS.max_tokens
    tight = make_engine(loaded, num_blocks=-(-longest // BS) + 1, prefix=False, max_batched_tokens=24)
    assert run(tight, everyone) == alone
    assert tight.stats().num_preemptions > 0


def test_the_cpp_decode_kernel_and_the_torch_op_path_agree(loaded, prompts, alone):
    """``alone`` decodes through the C++ kernel where it builds (rows widened in the kernel); the
    torch-op path (placed codes, gathered copies) gives the same greedy tokens."""
    from chatfleet.engine.models import paged_decode_cpu

    if not paged_decode_cpu.available():
        pytest.skip("no C++ compiler: both runs would take the torch-op path")
    assert make_engine(loaded).runner.decode_kernel == "cpp"
    torch_ops = make_engine(loaded, prefix=False, decode_kernel="torch")
    assert torch_ops.runner.decode_kernel == "torch"
    assert run(torch_ops, {f"r{i}": p for i, p in enumerate(prompts)}) == alone


def test_host_tier_reload_equals_alone(loaded, prompts, alone):
    longest = max(len(p) for p in prompts) + PARAMS.max_tokens
    engine = make_engine(loaded, num_blocks=-(-longest // BS) + 1, num_host_blocks=64)
    assert engine.runner.host_kv.host.dtype == torch.uint8  # raw FP8 bytes, nothing else
    run(engine, {f"r{i}": p for i, p in enumerate(prompts)})  # each evicts the one before
    got = run(engine, {"r0": prompts[0], "r2": prompts[2]})
    stats = engine.stats()
    assert stats.host_demotions > 0 and stats.host_promotions > 0 and stats.host_cache_hits > 0, stats
    assert got == {"r0": alone["r0"], "r2": alone["r2"]}


def test_missing_scales_warn_once_and_default_to_one(caplog):
    config = EngineConfig(model="tiny", kv_cache_dtype="fp8", cache=CacheConfig(num_tokens=256))
    with caplog.at_level(logging.WARNING):
        engine = Engine(config)
        prompt = engine.tokenizer.encode("hello there")
        run(engine, {"a": prompt})
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert [r.getMessage() for r in warnings] == [MISSING_SCALES_WARNING]
    assert {c.k_scale for c in engine.runner.kv_caches} == {1.0}


def test_scales_from_prompts_are_amax_over_448_then_frozen(caplog):
    config = EngineConfig(model="tiny", kv_cache_dtype="fp8", kv_scales_from_prompts=12,
                          cache=CacheConfig(num_tokens=256))
    with caplog.at_level(logging.WARNING):
        engine = Engine(config)
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]
    prompt = engine.tokenizer.encode("The storm over the glass sea came at night, and nobody slept.")
    assert len(prompt) > 12
    model = engine.runner.model
    amax = {}

    def observer(i):
        def observe(k, v):
            amax[i] = (float(k.abs().max()), float(v.abs().max()))
        return observe

    for i, layer in enumerate(model.layers):
        layer.self_attn.kv_observer = observer(i)
    with torch.inference_mode():
        model(torch.tensor(prompt[:12]), torch.arange(12))
    for layer in model.layers:
        layer.self_attn.kv_observer = None
    run(engine, {"a": prompt})
    caches = engine.runner.kv_caches
    assert [c.k_scale for c in caches] == pytest.approx([amax[i][0] / 448 for i in range(4)])
    assert [c.v_scale for c in caches] == pytest.approx([amax[i][1] / 448 for i in range(4)])
    before = [c.k_scale for c in caches]
    run(engine, {"b": engine.tokenizer.encode("Something else entirely, much louder!!")})
    assert [c.k_scale for c in caches] == before  # frozen


def test_pool_grows_by_the_byte_ratio_at_the_same_memory():
    memory = 3072 * BS * 20  # 20 float32 blocks of the tiny model
    cache = CacheConfig(memory_bytes=memory)
    pools = {kv: Engine(EngineConfig(model="tiny", kv_cache_dtype=kv, cache=cache)).kv.total_tokens
             for kv in ("auto", "bfloat16", "fp8")}
    assert pools == {"auto": 20 * BS, "bfloat16": 40 * BS, "fp8": 80 * BS}


def test_kv_scale_names_vllm_reads():
    assert match_kv_scale("model.layers.3.self_attn.k_scale") == (3, "k")
    assert match_kv_scale("model.layers.3.self_attn.attn.v_scale") == (3, "v")
    assert match_kv_scale("model.layers.0.self_attn.k_proj.k_scale") == (0, "k")
    assert match_kv_scale("model.layers.0.self_attn.v_proj.output_scale") == (0, "v")
    assert match_kv_scale("model.layers.1.self_attn.kv_scale") == (1, "kv")
    assert match_kv_scale("model.layers.1.self_attn.q_scale") == (-1, "ignored")
    assert match_kv_scale("model.layers.1.self_attn.k_proj.weight") is None


def test_scales_from_prompts_need_an_fp8_cache():
    with pytest.raises(ConfigError, match="needs --kv-cache-dtype fp8"):
        EngineConfig(kv_scales_from_prompts=8)
