"""The tokenizer and chat files every built-in model shares: a byte-level BPE trained on the
shipped corpus, ChatML special tokens and template (with Qwen3's tool layout), and the JSON files
beside the weights (tokenizer_config, special_tokens_map, generation_config).

``write_chat_tokenizer(out, vocab_size)`` trains and saves ``tokenizer.json`` and returns the
vocabulary size and special token ids; ``write_chat_files(out, token_ids, max_len)`` writes the
rest. ``tiny.py`` (Qwen3) and ``tiny_gemma4.py`` (Gemma 4) both build on them.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from chatfleet.engine.builtin_models.corpus import corpus_texts

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)

# Qwen2/Qwen3's pre-tokenizer pattern: letters runs, single digits, punctuation runs, spaces.
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# ChatML; content may be a string or a list of {"type": "text", "text": ...} parts. With
# ``tools``, Qwen3's tool layout: the tools as JSON lines in <tools></tools> in the system turn,
# an assistant's calls as <tool_call>{"name": ..., "arguments": ...}</tool_call>, and tool
# results grouped into one user turn as <tool_response>...</tool_response>.
CHAT_TEMPLATE = (
    "{%- macro text(content) %}"
    "{%- if content is string %}{{- content }}"
    "{%- elif content is not none %}"
    "{%- for part in content %}{%- if part['type'] == 'text' %}{{- part['text'] }}{%- endif %}{%- endfor %}"
    "{%- endif %}"
    "{%- endmacro %}"
    "{%- set ns = namespace(first=0) %}"
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages and messages[0]['role'] == 'system' %}"
    "{{- text(messages[0]['content']) + '\\n\\n' }}{%- set ns.first = 1 %}"
    "{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
    "{\"name\": <function-name>, \"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages[ns.first:] %}"
    "{%- if message['role'] == 'tool' %}"
    "{%- if loop.first or loop.previtem['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + text(message['content']) + '\\n</tool_response>' }}"
    "{%- if loop.last or loop.nextitem['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + text(message['content']) }}"
    "{%- for call in message['tool_calls'] or [] %}"
    "{%- if message['content'] or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": \"' + call['function']['name'] + '\", \"arguments\": ' }}"
    "{%- if call['function']['arguments'] is string %}{{- call['function']['arguments'] }}"
    "{%- else %}{{- call['function']['arguments'] | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def train_tokenizer(vocab_size: int) -> Tokenizer:
    """Byte-level BPE (Qwen-style pre-tokenizer) trained on the shipped multilingual corpus."""
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=list(SPECIAL_TOKENS),
        show_progress=False,
    )
    tok.train_from_iterator(corpus_texts(), trainer=trainer)
    return tok


def tokenizer_config(token_ids: dict[str, int], max_len: int) -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": CHAT_TEMPLATE,
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
        "unk_token": None,
        "add_bos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_len,
        "split_special_tokens": False,
        "added_tokens_decoder": {
            str(token_ids[t]): {
                "content": t, "lstrip": False, "rstrip": False, "normalized": False,
                "single_word": False, "special": True,
            }
            for t in SPECIAL_TOKENS
        },
    }


def write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def write_chat_tokenizer(out: Path, vocab_size: int) -> tuple[int, dict[str, int]]:
    """Train the tokenizer, save ``out/tokenizer.json``; the vocabulary size (with the special
    tokens) and each special token's id."""
    tok = train_tokenizer(vocab_size)
    tok.save(str(out / "tokenizer.json"))
    ids: dict[str, int] = {}
    for t in SPECIAL_TOKENS:
        tid = tok.token_to_id(t)
        if tid is None:  # trained in as special tokens, so always there
            raise RuntimeError(f"the trained tokenizer lacks its special token {t!r}")
        ids[t] = tid
    return tok.get_vocab_size(with_added_tokens=True), ids


def write_chat_files(out: Path, token_ids: dict[str, int], max_len: int) -> None:
    """``tokenizer_config.json`` (ChatML template), ``special_tokens_map.json`` and
    ``generation_config.json`` (stop on ``<|im_end|>`` or ``<|endoftext|>``)."""
    write_json(out / "tokenizer_config.json", tokenizer_config(token_ids, max_len))
    write_json(out / "special_tokens_map.json",
               {"eos_token": IM_END, "pad_token": ENDOFTEXT, "additional_special_tokens": [IM_START, IM_END]})
    write_json(out / "generation_config.json",
               {"bos_token_id": token_ids[ENDOFTEXT], "eos_token_id": [token_ids[IM_END], token_ids[ENDOFTEXT]],
                "pad_token_id": token_ids[ENDOFTEXT]})
