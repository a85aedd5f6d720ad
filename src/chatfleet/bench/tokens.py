"""Token counting for workload calibration: the target model's tokenizer, or an estimate."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from chatfleet.errors import ConfigError

# ChatML-style framing around each message (<|im_start|>role\n ... <|im_end|>\n) plus the
# assistant header that opens the reply. Real templates differ by a few tokens per message.
TOKENS_PER_MESSAGE = 5
TOKENS_PER_PROMPT = 3


class TokenCounter(Protocol):
    @property
    def name(self) -> str: ...

    def count(self, text: str) -> int: ...


@dataclass(frozen=True)
class EstimateCounter:
    """No tokenizer: about 4 bytes of UTF-8 per token (close for English BPE vocabularies)."""

    name: str = "estimate(4 bytes/token)"

    def count(self, text: str) -> int:
        return max(1, (len(text.encode("utf-8")) + 3) // 4) if text else 0


class HFTokenCounter:
    """Counts with a ``tokenizer.json`` through the ``tokenizers`` library."""

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer

        self.name = str(path)
        self._tok = Tokenizer.from_file(str(path))

    def count(self, text: str) -> int:
        return len(self._tok.encode(text, add_special_tokens=False).ids) if text else 0

    def count_batch(self, texts: list[str]) -> list[int]:
        return [len(e.ids) for e in self._tok.encode_batch(texts, add_special_tokens=False)]


def load_counter(spec: str | None) -> TokenCounter:
    """``None`` or ``'estimate'``: byte estimate; ``'tiny'``/``'small'``: the built-in models;
    otherwise a model folder holding tokenizer.json, or the tokenizer.json file itself."""
    if spec is None or spec == "estimate":
        return EstimateCounter()
    path = Path(spec)
    if not path.exists() and spec in ("tiny", "small"):
        from chatfleet.engine.builtin_models.tiny import resolve_model

        path = Path(resolve_model(spec))
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise ConfigError(
            f"no tokenizer at {spec!r}: give a model folder with tokenizer.json, the file itself, "
            "'tiny', 'small' or 'estimate'"
        )
    return HFTokenCounter(path)


def count_messages(counter: TokenCounter, messages: list[dict]) -> int:
    """Prompt tokens of a chat request: contents plus per-message template framing."""
    return TOKENS_PER_PROMPT + sum(TOKENS_PER_MESSAGE + counter.count(m["content"]) for m in messages)
