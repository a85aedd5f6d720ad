"""An engine process's argv from its config and back: config -> argv -> config is the identity."""

from __future__ import annotations

import dataclasses
import inspect
import sys

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from chatfleet.engine import __main__ as engine_main
from chatfleet.engine.api.options import ServerOptions
from chatfleet.engine.argv import FLAGS, EngineServer, engine_argv, field_paths, parse_engine_argv, with_flags
from chatfleet.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from chatfleet.engine.launcher import FleetConfig
from chatfleet.errors import ConfigError

TABLE = [
    (EngineConfig(), EngineServer()),
    (EngineConfig(model="/models/qwen3 folder", served_model_name="chat", dtype="bfloat16", device="cuda",
                  kernels="torch", seed=7, max_model_len=4096, num_threads=3, kv_cache_dtype="fp8",
                  kv_scales_from_prompts=64, quantization="fp8", embedding_dtype="fp8", language_model_only=False,
                  cache=CacheConfig(block_size=32, memory_bytes=3 * 2**30 + 5, eviction_policy="session",
                                    host_memory_bytes=12 * 2**30, host_eviction_policy="lfu",
                                    sliding_memory_fraction=0.1 + 0.2, keep_slid_out_blocks=False),
                  scheduler=SchedulerConfig(max_batched_tokens=512, max_running=4, max_waiting=0,
                                            enable_chunked_prefill=False, policy="lpm", max_queue_delay=2.5,
                                            lpm_host_weight=1.0)),
     EngineServer(host="0.0.0.0", port=0, log_level="warning",
                  options=ServerOptions(max_body_bytes=4096, request_timeout_s=1e-3, api_keys=("k1", "k-2"),
                                        enable_admin_api=True, salt_cache_per_key=False, tokenizer_workers=5,
                                        engine_process=False))),
    (EngineConfig(cache=CacheConfig(num_tokens=16, enable_prefix_caching=False), max_model_len=1,
                  scheduler=SchedulerConfig(max_queue_delay=0.0, lpm_host_weight=0.0)),
     EngineServer(port=65535, options=ServerOptions(request_timeout_s=1e9))),
    (EngineConfig(cache=CacheConfig(memory_bytes=512)), EngineServer()),  # 512 bytes, not 512 GiB
    (EngineConfig(device="cuda:1", gpu_memory_utilization=0.85, enforce_eager=True), EngineServer()),
    (EngineConfig(device="cpu"), EngineServer()),
    (EngineConfig(model="--", served_model_name="--port"),  # values that look like flags
     EngineServer(options=ServerOptions(api_keys=("-k", "--", "a=b")))),
]


@pytest.mark.parametrize("config,server", TABLE)
def test_round_trip_of_a_table_of_configs(config, server):
    argv = engine_argv(config, server)
    assert parse_engine_argv(argv) == (config, server)
    assert all(isinstance(a, str) for a in argv)


def test_defaults_write_no_flags():
    assert engine_argv(EngineConfig(), EngineServer()) == []


names = st.text(st.characters(min_codepoint=33, max_codepoint=126, exclude_characters=","), min_size=1, max_size=12)
floats = st.floats(min_value=0.0, max_value=1e6, allow_nan=False)
cache = st.builds(
    CacheConfig, block_size=st.sampled_from([1, 2, 16, 64]), num_tokens=st.none() | st.integers(64, 10**9),
    memory_bytes=st.none() | st.integers(1, 2**45), enable_prefix_caching=st.booleans(),
    eviction_policy=st.sampled_from(["lru", "lfu", "session"]), host_memory_bytes=st.integers(0, 2**40),
    host_eviction_policy=st.sampled_from(["lru", "lfu", "session"]),
    sliding_memory_fraction=st.none() | st.floats(1e-6, 1 - 1e-6), keep_slid_out_blocks=st.booleans())
scheduler = st.builds(
    SchedulerConfig, max_batched_tokens=st.integers(1, 10**6), max_running=st.integers(1, 10**4),
    max_waiting=st.integers(0, 10**6), enable_chunked_prefill=st.booleans(), policy=st.sampled_from(["fcfs", "lpm"]),
    max_queue_delay=floats, lpm_host_weight=st.floats(0.0, 1.0))
engine = st.builds(
    EngineConfig, model=names, served_model_name=st.none() | names,
    dtype=st.sampled_from(["float32", "bfloat16", "float16"]),
    device=st.sampled_from(["auto", "cpu", "cuda", "cuda:1"]),
    gpu_memory_utilization=st.none() | st.floats(1e-3, 1.0), enforce_eager=st.booleans(),
    kernels=st.sampled_from(["auto", "onednn", "torch"]), decode_kernel=st.sampled_from(["auto", "cpp", "torch"]),
    seed=st.integers(0, 2**32),
    max_model_len=st.none() | st.integers(1, 10**6), num_threads=st.none() | st.integers(1, 64),
    kv_cache_dtype=st.sampled_from(["auto", "float32", "bfloat16", "float16", "fp8"]),
    kv_scales_from_prompts=st.none() | st.integers(1, 10**4), quantization=st.sampled_from([None, "fp8"]),
    embedding_dtype=st.sampled_from(["auto", "fp8"]), language_model_only=st.booleans(),
    cache=cache, scheduler=scheduler)
server = st.builds(
    EngineServer, host=st.sampled_from(["127.0.0.1", "0.0.0.0", "::1", "localhost"]), port=st.integers(0, 65535),
    log_level=st.sampled_from(["critical", "error", "warning", "info", "debug"]),
    options=st.builds(ServerOptions, max_body_bytes=st.integers(1024, 2**40),
                      request_timeout_s=st.none() | st.floats(1e-6, 1e9),
                      api_keys=st.lists(names, max_size=3).map(tuple), enable_admin_api=st.booleans(),
                      salt_cache_per_key=st.booleans(), tokenizer_workers=st.integers(1, 16),
                      engine_process=st.booleans()))


@st.composite
def configs(draw):
    try:
        return draw(engine), draw(server)
    except ConfigError:
        assume(False)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow])
@given(configs())
def test_round_trip_of_drawn_configs(pair):
    config, srv = pair
    argv = engine_argv(config, srv)
    assert parse_engine_argv(argv) == (config, srv), argv


def test_every_config_field_has_one_flag():
    paths = [f.path for f in FLAGS]
    assert sorted(paths) == sorted(field_paths()) and len(set(paths)) == len(paths)
    assert len({f.name for f in FLAGS}) == len(FLAGS)
    nested = {f.name for cls in (EngineConfig, EngineServer) for f in dataclasses.fields(cls)
              if f.default_factory is not dataclasses.MISSING}
    assert nested == {"cache", "scheduler", "options"}  # sections, each with its own flags


def test_chatfleet_engine_takes_the_same_flags_and_builds_the_same_config(monkeypatch):
    from typer.testing import CliRunner

    from chatfleet.cli import engine_cmd
    from chatfleet.cli.main import app

    decls = set()
    for p in inspect.signature(engine_cmd.engine).parameters.values():
        for d in p.default.param_decls:
            decls.update(d.split("/"))
    assert {f.name for f in FLAGS if f.cli} <= decls
    assert {d for d in decls if d.startswith("--")} - {f.name for f in FLAGS} == {
        "--no-language-model-only", "--no-keep-slid-out-blocks", "--no-engine-process"}

    seen = []
    monkeypatch.setattr(engine_cmd, "serve_engine", lambda config, srv: seen.append((config, srv)))
    monkeypatch.setattr(engine_cmd, "check_port", lambda host, port: None)
    monkeypatch.delenv("CHATFLEET_API_KEY", raising=False)
    for config, srv in TABLE:
        if not srv.options.salt_cache_per_key or srv.options.tokenizer_workers != 2:
            continue  # settings `chatfleet engine` has no flag for
        argv = engine_argv(config, srv)
        result = CliRunner().invoke(app, ["engine", *argv])
        assert result.exit_code == 0, result.output
        assert seen.pop() == (config, srv)
        assert parse_engine_argv(argv) == (config, srv)


def test_device_and_gpu_memory_flags_are_checked():
    assert parse_engine_argv(["--device", "cuda:2", "--enforce-eager"])[0] == EngineConfig(
        device="cuda:2", enforce_eager=True)
    for bad in (["--device", "gpu"], ["--device", "cuda:x"], ["--gpu-memory-utilization", "0"],
                ["--gpu-memory-utilization", "1.5"], ["--device", "cpu", "--gpu-memory-utilization", "0.9"],
                ["--gpu-memory-utilization", "0.9", "--kv-cache-tokens", "4096"]):
        with pytest.raises(ConfigError):
            parse_engine_argv(bad)


def test_later_flags_win_and_bad_flags_fail_with_a_config_error():
    config, srv = with_flags(EngineConfig(model="m", num_threads=2), EngineServer(log_level="warning"),
                             ["--max-running", "3", "--log-level", "debug", "--kv-cache-memory", "2GiB"])
    assert (config.model, config.num_threads, config.scheduler.max_running) == ("m", 2, 3)
    assert config.cache.memory_bytes == 2 * 2**30 and srv.log_level == "debug"
    for bad in (["--bogus"], ["--max-running"], ["--max-running", "x"], ["--kv-cache-memory", "lots"],
                ["--eviction-policy", "nope"], ["--port", "70000"]):
        with pytest.raises(ConfigError):
            parse_engine_argv(bad)


def test_the_launcher_starts_the_engine_module_with_its_config():
    fleet = FleetConfig(replicas=1, model="tiny", host="127.0.0.1", threads_per_replica=2,
                        engine_args=("--kv-cache-tokens", "4096", "--no-prefix-cache"))
    from chatfleet.engine.launcher import Fleet

    cmd = Fleet(fleet).command(8123)
    assert cmd[:3] == [sys.executable, "-m", "chatfleet.engine"]
    config, srv = parse_engine_argv(cmd[3:])
    assert (config.model, config.num_threads, config.cache.num_tokens) == ("tiny", 2, 4096)
    assert not config.cache.enable_prefix_caching
    assert (srv.host, srv.port, srv.log_level, srv.options.enable_admin_api) == ("127.0.0.1", 8123, "warning", True)
    with pytest.raises(ConfigError):
        FleetConfig(engine_args=("--no-such-flag",))


def test_the_engine_module_fails_on_a_bad_flag_with_one_line(capsys):
    assert engine_main.main(["--max-running", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1
