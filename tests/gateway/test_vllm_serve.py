"""`chatfleet serve --engine vllm`: the profile's settings as vLLM flags, and the gateway's
affinity, flush and tenant salt against vLLM's CPU build where it is installed
(``bash benchmarks/setup_baselines.sh vllm``; skipped with the reason where it is not)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from chatfleet.cli.vllm_fleet import VllmFleet, vllm_flags
from chatfleet.engine.launcher import FleetConfig
from chatfleet.loopback import free_port

VLLM_PY = Path(__file__).resolve().parents[2] / "benchmarks" / ".venv-vllm" / "bin" / "python"


def test_the_profiles_settings_become_vllm_flags():
    config = FleetConfig(replicas=1, model="tiny", engine_args=(
        "--max-batched-tokens", "512", "--max-running", "24", "--kv-cache-dtype", "fp8",
        "--kv-cache-memory", "2GiB", "--host-cache-memory", "8GiB", "--max-model-len", "4096",
        "--eviction-policy", "session", "--api-key", "k1"))
    fleet = VllmFleet(config, python="/opt/vllm/bin/python")
    argv = fleet.command(8123)
    assert argv[:3] == ["/opt/vllm/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    pairs = dict(zip(argv[3::1], argv[4::1], strict=False))
    assert pairs["--port"] == "8123" and pairs["--model"] == "tiny"
    assert pairs["--max-num-batched-tokens"] == "512" and pairs["--max-num-seqs"] == "24"
    assert pairs["--kv-cache-dtype"] == "fp8" and pairs["--kv-cache-memory-bytes"] == str(2 << 30)
    assert pairs["--kv-offloading-backend"] == "native" and pairs["--kv-offloading-size"] == "8"
    assert pairs["--max-model-len"] == "4096" and pairs["--api-key"] == "k1"
    assert {"--enable-prefix-caching", "--enable-chunked-prefill", "--enable-prompt-tokens-details"} <= set(argv)
    assert "--block-size" not in argv
    assert fleet.dropped == ["--eviction-policy"]
    off, _ = vllm_flags(FleetConfig(replicas=1, engine_args=("--no-prefix-cache", "--no-chunked-prefill")).engine()[0])
    assert "--no-enable-prefix-caching" in off and "--no-enable-chunked-prefill" in off


def test_dtype_auto_reaches_vllm_as_our_engine_resolves_it():
    # Oracle: the engine's own resolution (models/dtype.py); vLLM's `auto` would take the checkpoint's
    # float32 where ours takes bfloat16 on a CPU with native bf16, and the two would compute apart.
    from chatfleet.engine.models.dtype import dtype_for_auto

    def dtype_of(*args: str) -> str:
        flags, _ = vllm_flags(FleetConfig(replicas=1, engine_args=args).engine()[0])
        return flags[flags.index("--dtype") + 1]

    assert dtype_of("--dtype", "auto") == dtype_for_auto("cpu") != "auto"
    assert dtype_of("--dtype", "bfloat16") == "bfloat16" and dtype_of("--dtype", "float32") == "float32"


def _vllm_ready() -> str | None:
    if not VLLM_PY.is_file():
        return "vLLM's CPU build is not installed (bash benchmarks/setup_baselines.sh vllm)"
    probe = subprocess.run([str(VLLM_PY), "-c", "import vllm"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"benchmarks/.venv-vllm cannot import vllm: {probe.stderr.strip()[-300:]}"
    return None


@pytest.fixture(scope="module")
def vllm_gateway(tmp_path_factory):
    reason = _vllm_ready()
    if reason:
        print(f"skipped: {reason}")
        pytest.skip(reason)
    port = free_port()
    logs = tmp_path_factory.mktemp("vllm")
    chatfleet = str(Path(sys.executable).with_name("chatfleet"))
    proc = subprocess.Popen(
        [chatfleet, "serve", "--engine", "vllm", "--vllm-python", str(VLLM_PY), "--replicas", "1",
         "--model", "tiny", "--threads-per-replica", "1", "--port", str(port),
         "--api-key", "key-a,key-b", "--admin-key", "root",
         "--engine-arg=--max-model-len=1024", "--engine-arg=--kv-cache-memory=256MiB"],
        stdout=open(logs / "serve.log", "wb"), stderr=subprocess.STDOUT, env=dict(os.environ))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 900
    try:
        while True:
            if proc.poll() is not None:
                pytest.fail(f"serve --engine vllm exited: {(logs / 'serve.log').read_text()[-3000:]}")
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"vLLM did not come up: {(logs / 'serve.log').read_text()[-3000:]}")
            time.sleep(1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


CARD = ("You are Captain Mira Vance of the starship Meridian. You speak in short, vivid sentences, "
        "you love old star charts, and you never reveal the ship's secret cargo. ") * 6


def _cached(url: str, key: str, system: str) -> tuple[int, str]:
    model = httpx.get(url + "/v1/models", headers={"authorization": f"Bearer {key}"}).json()["data"][0]["id"]
    body = {"model": model, "max_tokens": 1, "temperature": 0.0,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": "hi"}]}
    r = httpx.post(url + "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"}, timeout=300)
    assert r.status_code == 200, r.text
    details = r.json()["usage"].get("prompt_tokens_details") or {}
    return details.get("cached_tokens") or 0, r.headers["x-chatfleet-replica"]


def test_affinity_flush_and_tenant_salt_against_vllm(vllm_gateway):
    url = vllm_gateway
    first, replica = _cached(url, "key-a", CARD)
    again, same = _cached(url, "key-a", CARD)
    assert same == replica and again > 0, "vLLM's prefix cache holds A's prompt"
    assert _cached(url, "key-b", CARD)[0] == 0, "tenant B got tokens only A cached"
    r = httpx.post(url + "/reset_prefix_cache", headers={"authorization": "Bearer root"}, timeout=120)
    assert r.status_code == 200 and r.json()["success"], r.text
    assert _cached(url, "key-a", CARD)[0] == 0, "the flush through the gateway left A's prompt cached"
