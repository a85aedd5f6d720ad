"""Tokenizer of a Hugging Face model folder: tokenizer.json via `tokenizers`, chat template via jinja2.

No ``transformers`` at runtime. ``IncrementalDetokenizer`` turns a growing list of token ids into
text deltas without splitting multi-byte UTF-8 characters.
"""

from __future__ import annotations

import datetime
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from chatfleet.errors import ConfigError, InvalidRequestError

# Token strings treated as end-of-turn in addition to the folder's declared EOS ids.
DEFAULT_STOP_TOKENS = ("<|im_end|>", "<|endoftext|>")
REPLACEMENT_CHAR = "\ufffd"


def _token_str(value: Any) -> str | None:
    """tokenizer_config special-token entries are a string or {"content": ...}."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    with path.open(encoding="utf-8") as f:
        return json.load(f)


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else [v for v in value if isinstance(v, int)]


def _load_chat_template(folder: Path, tok_config: dict) -> str | None:
    """The folder's template: chat_template.jinja, chat_template.json or tokenizer_config.json."""
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = _read_json(folder / "chat_template.json").get("chat_template")
    if template is None:
        template = tok_config.get("chat_template")
    if isinstance(template, list):  # named templates: take "default"
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return template


def _raise_exception(message: str) -> None:
    raise InvalidRequestError(f"chat template error: {message}")


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _compile_template(source: str) -> jinja2.Template:
    """Compile like transformers does (sandboxed, trim_blocks, lstrip_blocks, loopcontrols)."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: Any = None, sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


class ChatTokenizer:
    """Encode, decode and render chats for one model folder."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        chat_template: str | None = None,
        eos_token: str | None = None,
        bos_token: str | None = None,
        extra_stop_token_ids: Sequence[int] = (),
    ) -> None:
        self._tok = tokenizer
        self.chat_template = chat_template
        self._template = _compile_template(chat_template) if chat_template else None
        self.eos_token = eos_token
        self.bos_token = bos_token
        self.eos_token_id: int | None = tokenizer.token_to_id(eos_token) if eos_token else None
        stops: list[int] = [] if self.eos_token_id is None else [self.eos_token_id]
        stops += list(extra_stop_token_ids)
        stops += [i for t in DEFAULT_STOP_TOKENS if (i := tokenizer.token_to_id(t)) is not None]
        self.stop_token_ids: tuple[int, ...] = tuple(dict.fromkeys(stops))
        if self.eos_token_id is None and self.stop_token_ids:
            self.eos_token_id = self.stop_token_ids[0]
        self.vocab_size: int = tokenizer.get_vocab_size(with_added_tokens=True)
        self.special_token_ids: frozenset[int] = frozenset(
            i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special
        )

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> ChatTokenizer:
        folder = Path(path)
        tok_file = folder / "tokenizer.json"
        if not tok_file.is_file():
            raise ConfigError(f"{str(folder)!r} has no tokenizer.json (a fast tokenizer is required)")
        tokenizer = Tokenizer.from_file(str(tok_file))
        tok_config = _read_json(folder / "tokenizer_config.json")
        gen_config = _read_json(folder / "generation_config.json")
        model_config = _read_json(folder / "config.json")
        extra = _as_id_list(gen_config.get("eos_token_id")) + _as_id_list(model_config.get("eos_token_id"))
        return cls(
            tokenizer,
            chat_template=_load_chat_template(folder, tok_config),
            eos_token=_token_str(tok_config.get("eos_token")),
            bos_token=_token_str(tok_config.get("bos_token")),
            extra_stop_token_ids=extra,
        )

    @property
    def backend(self) -> Tokenizer:
        """The underlying `tokenizers.Tokenizer`."""
        return self._tok

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``; special-token strings in it (``<|im_start|>``) map to their ids."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def token_text(self, token_id: int) -> str:
        """Text of one token as a client sees it (for logprobs); byte fragments become U+FFFD."""
        return self._tok.decode([token_id], skip_special_tokens=False)

    def apply_chat_template(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> str:
        """Render ``messages`` (content: a string or a list of {"type": "text", "text"} parts)."""
        if self._template is None:
            raise InvalidRequestError("this model has no chat template; use /v1/completions instead")
        try:
            return self._template.render(
                messages=list(messages),
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                **kwargs,
            )
        except jinja2.TemplateError as e:
            raise InvalidRequestError(f"chat template failed to render: {e}") from e

    def encode_chat(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True,
                    **kwargs: Any) -> list[int]:
        return self.encode(self.apply_chat_template(messages, add_generation_prompt, **kwargs))

    def incremental_detokenizer(self, prompt_token_ids: Sequence[int] = (),
                                skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, prompt_token_ids, skip_special_tokens)


class IncrementalDetokenizer:
    """Text deltas of a growing output; holds back bytes of an incomplete UTF-8 character.

    Decodes only a short window (``prefix_offset``..end) per step, so the cost per token stays
    constant. A few prompt tokens seed the window so a leading space decodes as in a full decode.
    ``flush()`` returns what is still held back (at the end of a request).
    """

    PROMPT_CONTEXT = 5

    def __init__(self, tokenizer: ChatTokenizer, prompt_token_ids: Sequence[int] = (),
                 skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = list(prompt_token_ids[-self.PROMPT_CONTEXT:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.text = ""  # all text emitted so far

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip)

    def add_tokens(self, token_ids: Sequence[int]) -> str:
        """Append ``token_ids``; return the newly complete text (may be "")."""
        self._ids.extend(token_ids)
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            return ""
        delta = new_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self.text += delta
        return delta

    def add_token(self, token_id: int) -> str:
        return self.add_tokens((token_id,))

    def flush(self) -> str:
        """Emit whatever is held back (incomplete bytes decode as U+FFFD)."""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        delta = new_text[len(prefix_text) :] if len(new_text) > len(prefix_text) else ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self.text += delta
        return delta
