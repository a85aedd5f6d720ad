"""The demo's and capacity benchmark's series: vLLM pinned to the same budget and dtype."""

import sys
from pathlib import Path

import pytest

from chatfleet.bench.demo import DemoConfig, demo_series, kv_budget_bytes
from chatfleet.bench.servers import SeriesSpec, _VLLMProcess
from chatfleet.engine.builtin_models.tiny import resolve_model
from chatfleet.engine.launcher import FleetConfig
from chatfleet.errors import ConfigError


def test_kv_budget_bytes_is_layers_times_kv_heads_times_head_dim_times_k_and_v():
    # tiny: 4 layers, 2 KV heads, head_dim 48, K and V, float32
    assert kv_budget_bytes(resolve_model("tiny"), 1024) == 1024 * 4 * 2 * 48 * 2 * 4


def test_vllm_series_runs_at_the_same_budget_and_dtype_with_a_resettable_cache():
    s = SeriesSpec.vllm("vllm", Path("/m"), 12_582_912, 1024, threads=1, python=Path(sys.executable))
    args = list(s.args)
    assert args[args.index("--dtype") + 1] == "float32"
    assert args[args.index("--kv-cache-memory-bytes") + 1] == "12582912"
    assert args[args.index("--max-model-len") + 1] == "896"  # vLLM CPU keeps one 128-token block back
    assert "--enable-prompt-tokens-details" in args and s.env["VLLM_SERVER_DEV_MODE"] == "1"
    assert s.server_kind == "vllm" and s.request_model == "bench"
    cmd = _VLLMProcess(FleetConfig(replicas=1, model="/m"), Path(sys.executable), s.args).command(8123)
    assert cmd[:3] == [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    assert cmd[cmd.index("--port") + 1] == "8123" and cmd[cmd.index("--model") + 1] == "/m"
    assert "--kv-cache-dtype" not in args  # its default: the model's dtype
    fp8 = SeriesSpec.vllm("vllm_fp8", Path("/m"), 12_582_912, 1024, threads=1, python=Path(sys.executable),
                          kv_cache_dtype="fp8")
    assert fp8.args[fp8.args.index("--kv-cache-dtype") + 1] == "fp8"
    assert fp8.args[fp8.args.index("--kv-cache-memory-bytes") + 1] == "12582912"  # the same bytes
    with pytest.raises(ConfigError, match="not installed"):
        SeriesSpec.vllm("vllm", Path("/m"), 1, 16, threads=1, python=Path("/nonexistent/python"))


def test_demo_series_share_one_budget(tmp_path):
    cfg = DemoConfig(model="tiny", kv_cache_tokens=1024, with_vllm=True, vllm_python=Path(sys.executable),
                     out_dir=tmp_path)
    series = {s.name: s for s in demo_series(cfg, resolve_model("tiny"))}
    assert set(series) == {"stock", "tuned", "vllm"}
    assert series["stock"].args == ("--kv-cache-tokens", "1024")
    assert series["tuned"].args[:2] == ("--kv-cache-tokens", "1024")
    vargs = list(series["vllm"].args)
    assert int(vargs[vargs.index("--kv-cache-memory-bytes") + 1]) == kv_budget_bytes(resolve_model("tiny"), 1024)


def test_working_set_is_live_chats_times_their_mean_context():
    from types import SimpleNamespace as N

    from chatfleet.bench.demo import working_set_tokens

    def r(prompt, out, warmup=False):
        return N(prompt_tokens=prompt, output_tokens=out, warmup=warmup)

    point = N(level=4, kept=[N(records=[r(100, 10), r(300, 10)]), N(records=[r(5000, 0, warmup=True)])])
    assert working_set_tokens(point) == 4 * (110 + 310) / 2  # the warmup request is left out
    assert working_set_tokens(N(level=4, kept=[N(records=[])])) is None
