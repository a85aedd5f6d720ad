"""ChatTokenizer: round trips, incremental detokenization, chat template parity with transformers."""

from __future__ import annotations

import random

import pytest

from chatfleet.engine.builtin_models.corpus import corpus_files
from chatfleet.engine.builtin_models.tiny import build_tiny_model
from chatfleet.engine.tokenizer import ChatTokenizer
from chatfleet.errors import InvalidRequestError

MESSAGES = [
    [{"role": "user", "content": "Hello!"}],
    [
        {"role": "system", "content": "You are Captain Mara, a lighthouse keeper."},
        {"role": "user", "content": "Привет! 你好！안녕하세요? こんにちは"},
        {"role": "assistant", "content": "Ahoy, traveller."},
        {"role": "user", "content": [{"type": "text", "text": "Tell me "}, {"type": "text", "text": "a story."}]},
    ],
    [{"role": "user", "content": ""}],
]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tok") / "m", size="tiny", seed=0)


@pytest.fixture(scope="module")
def tok(tiny_dir):
    return ChatTokenizer.from_pretrained(tiny_dir)


@pytest.fixture(scope="module")
def hf_tok(tiny_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_dir)


def test_special_ids(tok):
    assert tok.eos_token_id == tok.encode("<|im_end|>")[0]
    assert set(tok.stop_token_ids) == {tok.encode("<|im_end|>")[0], tok.encode("<|endoftext|>")[0]}
    assert tok.vocab_size == 4096


@pytest.mark.parametrize("name", sorted(corpus_files()))
def test_round_trip_every_script(tok, name):
    text = corpus_files()[name]
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert len(ids) < len(text.encode("utf-8"))  # BPE merged something in every script


def _incremental(tok, ids, prompt=(), chunk=1):
    detok = tok.incremental_detokenizer(prompt)
    pieces = [detok.add_tokens(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    pieces.append(detok.flush())
    assert "".join(pieces) == detok.text
    return pieces


@pytest.mark.parametrize("chunk", [1, 3])
def test_incremental_equals_full_decode(tok, chunk):
    text = "".join(corpus_files().values())
    ids = tok.encode(text)
    pieces = _incremental(tok, ids, chunk=chunk)
    assert "".join(pieces) == tok.decode(ids)
    assert not any("\ufffd" in p for p in pieces)  # no character was split into bad halves


def test_incremental_holds_back_split_characters(tok):
    from tokenizers.pre_tokenizers import ByteLevel

    # One token per UTF-8 byte, so every character below spans 2-4 tokens.
    text = "é漢😀"
    mapped = ByteLevel(add_prefix_space=False, use_regex=False).pre_tokenize_str(text)[0][0]
    ids = [tok.backend.token_to_id(c) for c in mapped]
    assert len(ids) == len(text.encode("utf-8")) and tok.decode(ids) == text
    pieces = _incremental(tok, ids)
    assert [p for p in pieces if p] == ["é", "漢", "😀"]


def test_incremental_random_ids_equal_full_decode(tok):
    rng = random.Random(0)
    for _ in range(30):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 40))]
        pieces = _incremental(tok, ids, chunk=rng.choice([1, 2, 5]))
        assert "".join(pieces) == tok.decode(ids)


def test_incremental_with_prompt_context(tok):
    prompt = tok.encode_chat([{"role": "user", "content": "Hi"}])
    out = tok.encode(" Ahoy there, 旅人さん!") + [tok.eos_token_id]
    assert "".join(_incremental(tok, out, prompt=prompt)) == tok.decode(out)


@pytest.mark.parametrize("messages", MESSAGES)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(tok, hf_tok, messages, add_generation_prompt):
    ours = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    theirs = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours == theirs
    assert tok.encode(ours) == hf_tok(ours, add_special_tokens=False).input_ids


def test_encoding_matches_transformers(tok, hf_tok):
    for text in corpus_files().values():
        assert tok.encode(text) == hf_tok(text, add_special_tokens=False).input_ids


def test_no_template_is_a_client_error(tiny_dir):
    plain = ChatTokenizer(ChatTokenizer.from_pretrained(tiny_dir).backend, chat_template=None)
    with pytest.raises(InvalidRequestError, match="no chat template"):
        plain.apply_chat_template([{"role": "user", "content": "x"}])
