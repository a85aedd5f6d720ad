"""The engine's HTTP API through the official openai client, on one real server (tiny model, loopback)."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
import torch

from chatfleet.engine.api.async_engine import AsyncEngine
from chatfleet.engine.api.options import ServerOptions
from chatfleet.engine.api.server import build_app
from chatfleet.engine.builtin_models.tiny import resolve_model
from chatfleet.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from chatfleet.loopback import ServerThread

MAX_MODEL_LEN = 1024
BLOCK = 16
GREEDY = {"temperature": 0.0}
FORCE = {"ignore_eos": True}  # extra_body: make reply lengths exact


@pytest.fixture(scope="module")
def server():
    from chatfleet.engine.engine import Engine

    torch.set_num_threads(1)
    config = EngineConfig(
        model="tiny", num_threads=1, max_model_len=MAX_MODEL_LEN,
        cache=CacheConfig(block_size=BLOCK, num_tokens=8192),
        scheduler=SchedulerConfig(max_batched_tokens=256),
    )
    engine = AsyncEngine(Engine(config), check_integrity_when_idle=True)
    with ServerThread(build_app(engine, options=ServerOptions(enable_admin_api=True))) as srv:
        srv.engine = engine
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)


def engine_call(server, fn):
    return server.engine.call_threadsafe(fn).result(timeout=30)


def metrics(server) -> dict[str, float]:
    out = {}
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name.split("{")[0] if "_bucket" not in name else name] = float(value)
    return out


def aborted(server) -> float:
    """vllm:request_success_total{finished_reason="abort"}."""
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if line.startswith("vllm:request_success_total{") and 'finished_reason="abort"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def chat(client, content, **kw):
    extra = kw.pop("extra_body", {})
    return client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": content}], extra_body=extra, **kw
    )


def long_text(n_words: int, seed: str) -> str:
    return " ".join(f"{seed}{i % 97} word" for i in range(n_words))


# ------------------------------------------------------------------ chat


def test_chat_non_stream_usage_and_length(server, client):
    r = chat(client, "Hello there!", max_tokens=7, extra_body=FORCE, **GREEDY)
    choice = r.choices[0]
    assert choice.finish_reason == "length" and choice.message.role == "assistant"
    n_prompt = httpx.post(server.url + "/tokenize",
                          json={"messages": [{"role": "user", "content": "Hello there!"}]}).json()["count"]
    assert r.usage.prompt_tokens == n_prompt
    assert r.usage.completion_tokens == 7 and r.usage.total_tokens == n_prompt + 7
    assert r.usage.prompt_tokens_details.cached_tokens >= 0
    assert r.model == "tiny" and r.id.startswith("chatcmpl-")


def test_chat_stream_matches_non_stream_and_reports_usage(client):
    whole = chat(client, "Tell me a story", max_tokens=12, extra_body=FORCE, **GREEDY)
    chunks = list(chat(client, "Tell me a story", max_tokens=12, stream=True,
                       stream_options={"include_usage": True}, extra_body=FORCE, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and not any(finishes[:-1])
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == 12
    assert last.usage.prompt_tokens == whole.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_stop_string_truncates_and_finishes_with_stop(client):
    base = chat(client, "Say something long", max_tokens=40, extra_body=FORCE, **GREEDY).choices[0].message.content
    stop = next((base[i:i + 3] for i in range(5, len(base) - 3) if base[i:i + 3].strip() == base[i:i + 3]), None)
    if stop is None:
        pytest.skip("greedy text has no usable stop substring")
    r = chat(client, "Say something long", max_tokens=40, stop=[stop], extra_body=FORCE, **GREEDY)
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == base[: base.index(stop)]


def test_chat_logprobs_greedy_token_is_top(client):
    r = chat(client, "hi", max_tokens=5, logprobs=True, top_logprobs=3, extra_body=FORCE, **GREEDY)
    content = r.choices[0].logprobs.content
    assert len(content) == 5
    for tok in content:
        assert len(tok.top_logprobs) == 3
        assert tok.logprob == pytest.approx(tok.top_logprobs[0].logprob, abs=1e-5)
        assert tok.logprob <= 0
    assert "".join(t.token for t in content) == r.choices[0].message.content


def test_seeded_sampling_is_reproducible(client):
    def sample(seed):
        return chat(client, "Pick words", max_tokens=16, temperature=1.0, seed=seed,
                    extra_body=FORCE).choices[0].message.content

    a, b = sample(1234), sample(1234)
    assert a == b
    assert any(sample(s) != a for s in (1, 2, 3))


# ------------------------------------------------------------------ prefix cache


def test_repeated_long_prompt_reports_cached_tokens_and_reset_clears(server, client):
    prompt = long_text(60, "cache")
    first = chat(client, prompt, max_tokens=4, extra_body=FORCE, **GREEDY)
    second = chat(client, prompt, max_tokens=4, extra_body=FORCE, **GREEDY)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached > 0 and cached % BLOCK == 0 and cached < second.usage.prompt_tokens
    assert first.choices[0].message.content == second.choices[0].message.content

    reset = httpx.post(server.url + "/reset_prefix_cache").json()
    assert reset == {"success": True, "prefix_cache_empty": True}
    assert engine_call(server, lambda e: e.stats().num_cached_blocks) == 0
    third = chat(client, prompt, max_tokens=4, extra_body=FORCE, **GREEDY)
    assert third.usage.prompt_tokens_details.cached_tokens == 0
    assert third.choices[0].message.content == first.choices[0].message.content


# ------------------------------------------------------------------ legacy completions


def test_completion_echo_logprobs_match_direct_forward(server, client):
    from transformers import Qwen3ForCausalLM

    text = "The quick brown fox jumps over the lazy dog. Ünïcödé и кириллица 日本語"
    r = client.completions.create(model="tiny", prompt=text, max_tokens=0, echo=True, logprobs=2)
    choice = r.choices[0]
    assert choice.text == text and r.usage.completion_tokens == 0
    ids = httpx.post(server.url + "/tokenize", json={"prompt": text}).json()["tokens"]
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)

    model = Qwen3ForCausalLM.from_pretrained(resolve_model("tiny"), torch_dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    expected = torch.log_softmax(logits, dim=-1)[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    got = torch.tensor(lp.token_logprobs[1:])
    assert torch.allclose(got, expected, atol=1e-3), (got - expected).abs().max()
    for i in range(1, len(ids)):
        assert lp.tokens[i] in lp.top_logprobs[i] and len(lp.top_logprobs[i]) <= 3


def test_completion_token_ids_stream_and_echo(server, client):
    ids = httpx.post(server.url + "/tokenize", json={"prompt": "Once upon a time"}).json()["tokens"]
    whole = client.completions.create(model="tiny", prompt=ids, max_tokens=6, temperature=0, extra_body=FORCE)
    assert whole.usage.prompt_tokens == len(ids) and whole.usage.completion_tokens == 6
    chunks = list(client.completions.create(model="tiny", prompt=[ids], max_tokens=6, temperature=0, echo=True,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body=FORCE))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == "Once upon a time" + whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 6


# ------------------------------------------------------------------ disconnect


def test_client_disconnect_mid_stream_frees_blocks(server):
    body = {"model": "tiny", "messages": [{"role": "user", "content": long_text(40, "dc")}],
            "max_tokens": 800, "ignore_eos": True, "stream": True}
    finished_before = engine_call(server, lambda e: e.stats().num_finished)
    aborted_before = aborted(server)
    with httpx.Client(timeout=30) as c, c.stream("POST", server.url + "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        got = 0
        for line in lines:
            if line.startswith("data: "):
                got += 1
            if got >= 4:
                break
        assert engine_call(server, lambda e: e.stats().num_running) == 1
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        stats = engine_call(server, lambda e: e.stats())
        if stats.num_running == 0 and stats.num_waiting == 0 and stats.kv_usage == 0:
            break
        time.sleep(0.02)
    assert (stats.num_running, stats.num_waiting, stats.kv_usage) == (0, 0, 0)
    assert stats.num_finished == finished_before  # aborted, not run to its length
    assert aborted(server) == aborted_before + 1  # counted as vLLM counts it
    engine_call(server, lambda e: e.check_integrity())
    m = metrics(server)
    assert m["vllm:num_requests_running"] == 0 and m["vllm:kv_cache_usage_perc"] == 0


# ------------------------------------------------------------------ bad input

MSG = [{"role": "user", "content": "hi"}]
BAD_CHAT = [
    ("malformed json", b'{"model": "tiny", "messages": [', None),
    ("not an object", b"[1, 2]", None),
    ("empty body", b"", None),
    ("messages wrong type", {"messages": "hi"}, "messages"),
    ("max_tokens wrong type", {"messages": MSG, "max_tokens": "ten"}, "max_tokens"),
    ("temperature wrong type", {"messages": MSG, "temperature": "hot"}, "temperature"),
    ("negative max_tokens", {"messages": MSG, "max_tokens": -5}, "max_tokens"),
    ("huge max_tokens", {"messages": MSG, "max_tokens": 10**9}, "max_tokens"),
    ("empty messages", {"messages": []}, "messages"),
    ("bad role", {"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
    ("empty stop", {"messages": MSG, "stop": ""}, "stop"),
    ("stop wrong type", {"messages": MSG, "stop": 7}, "stop"),
    ("top_logprobs without logprobs", {"messages": MSG, "top_logprobs": 2}, None),
    ("too many top_logprobs", {"messages": MSG, "logprobs": True, "top_logprobs": 99}, "top_logprobs"),
    ("stream_options without stream", {"messages": MSG, "stream_options": {"include_usage": True}}, None),
    ("negative temperature", {"messages": MSG, "temperature": -1}, "temperature"),
    ("prompt too long", {"messages": [{"role": "user", "content": long_text(600, "x")}]}, None),
]
BAD_COMPLETION = [
    ("empty prompt", {"prompt": ""}, "prompt"),
    ("token id out of vocab", {"prompt": [1, 2, 10**7]}, "prompt"),
    ("negative token id", {"prompt": [1, -2]}, "prompt"),
    ("prompt too long", {"prompt": list(range(3, 3 + MAX_MODEL_LEN)), "max_tokens": 1}, "max_tokens"),
]


def _post(server, path, body):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(server.url + path, content=content, headers={"content-type": "application/json"}, timeout=30)


@pytest.mark.parametrize("path,case", [("/v1/chat/completions", c) for c in BAD_CHAT]
                         + [("/v1/completions", c) for c in BAD_COMPLETION],
                         ids=lambda c: c if isinstance(c, str) else c[0])
def test_bad_input_gets_400_in_openai_format(server, path, case):
    _, body, param = case
    r = _post(server, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["message"]
    if param is not None:
        assert err["param"] == param, err


@pytest.mark.parametrize("path,body", [("/v1/chat/completions", {"model": "gpt-9", "messages": MSG}),
                                       ("/v1/completions", {"model": "gpt-9", "prompt": "hi"})])
def test_unknown_model_is_404_model_not_found(server, path, body):
    r = _post(server, path, body)
    assert r.status_code == 404, r.text
    err = r.json()["error"]
    assert err["code"] == "model_not_found" and err["param"] == "model" and "gpt-9" in err["message"]


def test_models_route_lists_and_finds_the_served_model(server):
    listed = httpx.get(server.url + "/v1/models").json()["data"]
    assert [m["id"] for m in listed] == ["tiny"]
    one = httpx.get(server.url + "/v1/models/tiny")
    assert one.status_code == 200 and one.json()["id"] == "tiny" and one.json()["object"] == "model"
    missing = httpx.get(server.url + "/v1/models/gpt-9")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def test_server_healthy_after_bad_input(server, client):
    for _, body, _ in BAD_CHAT[:5]:
        _post(server, "/v1/chat/completions", body)
    assert httpx.get(server.url + "/health").status_code == 200
    assert chat(client, "still there?", max_tokens=3, extra_body=FORCE).usage.completion_tokens == 3
    assert engine_call(server, lambda e: e.stats().num_running) == 0


def test_openai_client_raises_bad_request(client):
    with pytest.raises(openai.BadRequestError) as ei:
        chat(client, "x", max_tokens=-1)
    assert ei.value.body["param"] == "max_tokens"


# ------------------------------------------------------------------ small endpoints


def test_models_health_tokenize(server, client):
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny"]
    assert httpx.get(server.url + "/health").status_code == 200
    t = httpx.post(server.url + "/tokenize", json={"prompt": "hello world"}).json()
    assert t["count"] == len(t["tokens"]) > 0 and t["max_model_len"] == MAX_MODEL_LEN
    assert httpx.post(server.url + "/tokenize", json={}).status_code == 400


def test_metrics_names(server, client):
    chat(client, "count me", max_tokens=3, extra_body=FORCE)
    text = httpx.get(server.url + "/metrics").text
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:prompt_tokens_total",
                 "vllm:generation_tokens_total", "vllm:num_preemptions_total", "vllm:request_success_total",
                 "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
                 "vllm:e2e_request_latency_seconds_bucket", "vllm:request_queue_time_seconds_bucket"):
        assert f'{name}{{' in text, name
    assert 'model_name="tiny"' in text
    m = metrics(server)
    assert m["vllm:generation_tokens_total"] >= 3 and m["vllm:time_to_first_token_seconds_count"] >= 1
    assert m["vllm:request_queue_time_seconds_count"] >= 1


def test_logit_bias_steers_greedy_decoding_and_bad_values_are_400(server, client):
    tok = server.engine.tokenizer
    forced = 65
    r = chat(client, "anything", max_tokens=5, logit_bias={str(forced): 100},
             extra_body={**FORCE, "repetition_penalty": 1.0}, **GREEDY)
    assert r.choices[0].message.content == tok.decode([forced] * 5)
    for body, param in (({"logit_bias": {"999999": 5}}, "logit_bias"), ({"logit_bias": "x"}, "logit_bias"),
                        ({"repetition_penalty": -1}, "repetition_penalty"), ({"min_p": 2}, "min_p"),
                        ({"presence_penalty": 9}, "presence_penalty")):
        bad = _post(server, "/v1/chat/completions", {"messages": MSG, **body})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == param, bad.text


def test_a_penalized_request_runs_beside_plain_ones_without_changing_them(server, client):
    plain = chat(client, "same prompt", max_tokens=6, extra_body=FORCE, **GREEDY).choices[0].message.content
    penalized = chat(client, "same prompt", max_tokens=6, frequency_penalty=2.0, presence_penalty=2.0,
                     extra_body={**FORCE, "repetition_penalty": 1.5, "min_p": 0.1}, **GREEDY)
    assert penalized.usage.completion_tokens == 6
    assert chat(client, "same prompt", max_tokens=6, extra_body=FORCE, **GREEDY).choices[0].message.content == plain


# ------------------------------------------------------------------ several choices


def test_batched_prompts_answer_one_choice_each_as_alone(server, client):
    prompts = ["The first", "A second prompt", "third"]
    alone = [client.completions.create(model="tiny", prompt=p, max_tokens=4, temperature=0,
                                       extra_body=FORCE).choices[0].text for p in prompts]
    r = client.completions.create(model="tiny", prompt=prompts, max_tokens=4, temperature=0, extra_body=FORCE)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == alone
    ids = [httpx.post(server.url + "/tokenize", json={"prompt": p}).json()["tokens"] for p in prompts]
    assert r.usage.prompt_tokens == sum(map(len, ids)) and r.usage.completion_tokens == 12
    by_ids = client.completions.create(model="tiny", prompt=ids, max_tokens=4, temperature=0, extra_body=FORCE)
    assert [c.text for c in by_ids.choices] == alone


def test_lm_eval_local_completions_loglikelihood_batch(server):
    """The exact payload lm-eval's local-completions sends for loglikelihood with --batch_size 4."""
    ids = [httpx.post(server.url + "/tokenize", json={"prompt": p}).json()["tokens"]
           for p in ("Question: two plus two? Answer: four", "Q: sky colour? A: blue", "x y z", "hello world")]
    payload = {"model": "tiny", "prompt": ids, "temperature": 0, "max_tokens": 1, "logprobs": 1,
               "seed": 1234, "echo": True}
    out = httpx.post(server.url + "/v1/completions", json=payload, timeout=60).json()
    choices = sorted(out["choices"], key=lambda c: c["index"])
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    for choice, prompt in zip(choices, ids, strict=True):
        lps = choice["logprobs"]
        assert len(lps["token_logprobs"]) == len(prompt) + 1 and lps["token_logprobs"][0] is None
        assert all(v <= 0 for v in lps["token_logprobs"][1:])
        assert all(len(top) >= 1 for top in lps["top_logprobs"][1:])
        alone = httpx.post(server.url + "/v1/completions", json={**payload, "prompt": prompt}, timeout=60).json()
        alone_lps = alone["choices"][0]["logprobs"]["token_logprobs"]
        assert alone_lps[1:-1] == pytest.approx(lps["token_logprobs"][1:-1], abs=1e-4)


def test_n_choices_share_the_prompt_through_the_prefix_cache(server, client):
    prompt = long_text(50, "nshare")
    before = engine_call(server, lambda e: e.stats().prefix_cache_hits)
    r = chat(client, prompt, max_tokens=5, n=3, temperature=1.0, seed=11, extra_body=FORCE)
    hits = engine_call(server, lambda e: e.stats().prefix_cache_hits) - before
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert r.usage.completion_tokens == 15
    full_blocks = (r.usage.prompt_tokens // BLOCK) * BLOCK
    assert hits >= 2 * min(full_blocks, r.usage.prompt_tokens - 1) - 2 * BLOCK  # choices 1, 2 hit the prompt
    assert len({c.message.content for c in r.choices}) > 1  # seeds differ per choice
    again = chat(client, prompt, max_tokens=5, n=3, temperature=1.0, seed=11, extra_body=FORCE)
    assert [c.message.content for c in again.choices] == [c.message.content for c in r.choices]


def test_n_choices_stream_interleaved_by_index(server, client):
    prompt = long_text(40, "nstream")
    kw = {"max_tokens": 6, "n": 3, "temperature": 1.0, "seed": 5, "extra_body": FORCE}
    whole = chat(client, prompt, **kw)
    texts, roles, finishes, order, usage = {}, {}, {}, [], None
    for chunk in chat(client, prompt, stream=True, stream_options={"include_usage": True}, **kw):
        if chunk.usage is not None:
            assert not chunk.choices
            usage = chunk.usage
        for c in chunk.choices:
            order.append(c.index)
            roles[c.index] = roles.get(c.index) or c.delta.role
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            finishes[c.index] = c.finish_reason or finishes.get(c.index)
    assert sorted(set(order)) == [0, 1, 2] and roles == {0: "assistant", 1: "assistant", 2: "assistant"}
    assert finishes == {0: "length", 1: "length", 2: "length"}
    assert [texts[i] for i in range(3)] == [c.message.content for c in whole.choices]  # same seeds, same samples
    assert usage.completion_tokens == 18 and usage.prompt_tokens == whole.usage.prompt_tokens


def test_batched_completion_prompts_with_n_stream_every_choice(server, client):
    kw = {"model": "tiny", "prompt": ["one two three", "four five"], "n": 2, "max_tokens": 4,
          "temperature": 1.0, "seed": 3, "extra_body": FORCE}
    whole = client.completions.create(**kw)
    texts: dict[int, str] = {}
    usage = None
    for chunk in client.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        usage = chunk.usage or usage
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert texts == {c.index: c.text for c in whole.choices} and len(texts) == 4
    assert usage.completion_tokens == 16 and usage.prompt_tokens == whole.usage.prompt_tokens


def test_a_client_leaving_a_streamed_fan_out_frees_every_choice(server):
    body = {"model": "tiny", "messages": MSG, "n": 4, "max_tokens": 200, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        next(r.iter_lines())
    deadline = time.monotonic() + 10
    while engine_call(server, lambda e: e.has_unfinished_requests()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not engine_call(server, lambda e: e.has_unfinished_requests())
