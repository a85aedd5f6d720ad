"""Constrained decoding on the random-weight tiny model, which left alone almost never writes JSON.

For random JSON schemas (hypothesis; finite ones: bounded strings, integers, arrays and enums, so a
reply can finish), every reply that finishes parses and validates against its schema, sampled
greedily and at temperature 1; unconstrained requests batched beside constrained ones give the
same greedy tokens as alone; the batch's bitmask allows exactly what each request's grammar does.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chatfleet.engine.builtin_models.tiny import resolve_model
from chatfleet.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from chatfleet.engine.engine import Engine
from chatfleet.engine.models.loader import load_model
from chatfleet.engine.request import SamplingParams
from chatfleet.engine.runner.torch_runner import TorchRunner
from chatfleet.engine.structured.spec import GrammarSpec
from chatfleet.errors import InvalidRequestError

BS = 16
MAX_LEN = 2048
NUM_BLOCKS = 1024


@pytest.fixture(scope="module")
def loaded():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield load_model(resolve_model("tiny"), dtype="float32")
    torch.set_num_threads(threads)


def make_engine(loaded) -> Engine:
    config = EngineConfig(model="tiny", max_model_len=MAX_LEN,
                          cache=CacheConfig(block_size=BS, num_tokens=NUM_BLOCKS * BS),
                          scheduler=SchedulerConfig(max_batched_tokens=512))
    return Engine(config, runner=TorchRunner(loaded, NUM_BLOCKS, BS), tokenizer=loaded.tokenizer)


@pytest.fixture(scope="module")
def engine(loaded):
    return make_engine(loaded)


def drain(engine: Engine) -> dict[str, tuple[list[int], str, str | None]]:
    """Step until idle: request id -> (tokens, text, finish reason)."""
    tokens: dict[str, list[int]] = {}
    text: dict[str, list[str]] = {}
    finish: dict[str, str | None] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            text.setdefault(o.request_id, []).append(o.new_text)
            if o.finished:
                finish[o.request_id] = o.finish_reason
        engine.check_integrity()
    return {rid: (tokens[rid], "".join(text[rid]), finish.get(rid)) for rid in tokens}


KEYS = st.text(alphabet="abcdefghij_", min_size=1, max_size=6)
LEAVES = st.one_of(
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.tuples(st.integers(-1000, 1000), st.integers(0, 1000)).map(
        lambda t: {"type": "integer", "minimum": t[0], "maximum": t[0] + t[1]}),
    st.integers(0, 8).map(lambda n: {"type": "string", "maxLength": n}),
    st.lists(st.one_of(st.text(max_size=5), st.integers(-99, 99), st.booleans()), min_size=1, max_size=4,
             unique_by=lambda v: json.dumps(v)).map(lambda vs: {"enum": vs}),
    st.just({"type": "string", "pattern": "^[a-z]{1,4}-[0-9]{2}$"}),
)


def _object(children):
    return st.dictionaries(KEYS, children, min_size=1, max_size=3).flatmap(lambda props: st.sets(
        st.sampled_from(sorted(props))).map(lambda req: {
            "type": "object", "properties": props, "required": sorted(req), "additionalProperties": False}))


SCHEMAS = st.recursive(LEAVES, lambda children: st.one_of(
    _object(children),
    st.tuples(children, st.integers(0, 3)).map(lambda t: {"type": "array", "items": t[0], "maxItems": t[1]}),
    st.lists(children, min_size=2, max_size=2).map(lambda s: {"anyOf": s}),
), max_leaves=6)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(schemas=st.lists(SCHEMAS, min_size=6, max_size=6), seed=st.integers(0, 2**31))
def test_every_reply_follows_its_random_schema(engine, schemas, seed):
    prompt = engine.tokenizer.encode("Reply in JSON.")
    for i, schema in enumerate(schemas):
        params = SamplingParams(max_tokens=600, temperature=0.0 if i % 2 else 1.0, seed=seed + i,
                                grammar=GrammarSpec.json_schema(schema))
        engine.add_request(f"r{i}", prompt, params)
    replies = drain(engine)
    for i, schema in enumerate(schemas):
        _, text, finish = replies[f"r{i}"]
        assert finish == "stop", json.dumps({"schema": schema, "text": text})
        jsonschema.validate(json.loads(text), schema)
    assert len(engine.structured) == 0  # finished requests hold no matcher


def test_unconstrained_left_alone_is_not_json(engine):
    """The oracle's point: without a grammar, the model's replies do not parse."""
    prompt = engine.tokenizer.encode("Reply in JSON.")
    for i in range(4):
        engine.add_request(f"free{i}", prompt, SamplingParams(max_tokens=40, temperature=1.0, seed=i))
    replies = drain(engine)
    parsed = 0
    for _, text, _ in replies.values():
        try:
            json.loads(text)
            parsed += 1
        except ValueError:
            pass
    assert parsed == 0


def test_unconstrained_batched_beside_constrained_match_alone(loaded):
    tok = loaded.tokenizer
    prompts = [tok.encode(t) for t in ("Tell me of the storm.", "Where to, captain?", "Count the coins.")]
    plain = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    alone = {}
    for i, p in enumerate(prompts):
        engine = make_engine(loaded)
        engine.add_request(f"u{i}", p, plain)
        alone[f"u{i}"] = drain(engine)[f"u{i}"][0]
    engine = make_engine(loaded)
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}}, "required": ["name"],
              "additionalProperties": False}
    for i, p in enumerate(prompts):
        engine.add_request(f"c{i}", p, SamplingParams(max_tokens=60, temperature=1.0, seed=i,
                                                      grammar=GrammarSpec.json_schema(schema)))
        engine.add_request(f"u{i}", p, plain)
    batched = drain(engine)
    assert {rid: batched[rid][0] for rid in alone} == alone
    for i in range(3):
        assert batched[f"c{i}"][2] == "stop"
        jsonschema.validate(json.loads(batched[f"c{i}"][1]), schema)


def test_max_tokens_inside_a_constrained_reply_ends_with_length(engine):
    schema = {"type": "array", "items": {"type": "string", "maxLength": 8}, "minItems": 20}
    engine.add_request("cut", engine.tokenizer.encode("List."), SamplingParams(
        max_tokens=5, temperature=0.0, grammar=GrammarSpec.json_schema(schema)))
    tokens, text, finish = drain(engine)["cut"]
    assert finish == "length" and len(tokens) == 5
    assert text.startswith("[")
    with pytest.raises(ValueError):
        json.loads(text)


def test_an_uncompilable_schema_is_a_client_error_naming_the_problem(engine):
    bad = GrammarSpec.json_schema({"type": "string", "pattern": "(?<=a)b"})
    with pytest.raises(InvalidRequestError, match="look-around"):
        engine.add_request("bad", [1, 2, 3], SamplingParams(max_tokens=4, grammar=bad))
    assert not engine.has_unfinished_requests() and len(engine.structured) == 0


def test_abort_drops_the_matcher(engine):
    engine.add_request("gone", [5, 6, 7], SamplingParams(
        max_tokens=50, grammar=GrammarSpec.json_schema({"type": "object"})))
    assert "gone" in engine.structured
    engine.abort_request("gone")
    assert "gone" not in engine.structured
    drain(engine)
