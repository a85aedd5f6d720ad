"""Persona cards and chat turns built from the project's templates and word lists.

Languages live in ``bench/data/<code>.json`` (labels, word lists, sentence patterns); the card
layout is ``bench/templates/card.j2``. Text is grown sentence by sentence until it reaches a
token target measured with the given counter.
"""

from __future__ import annotations

import functools
import json
import random
from dataclasses import dataclass
from importlib import resources

import jinja2

from chatfleet.bench.tokens import TokenCounter
from chatfleet.errors import ConfigError

LANGUAGES = ("en", "es", "de", "ru")
_SLOTS = {"trait": "traits", "role": "roles", "place": "places", "object": "objects",
          "feeling": "feelings", "activity": "activities"}


@dataclass(frozen=True)
class Language:
    code: str
    labels: dict
    words: dict  # slot -> list of words
    sentences: dict  # kind -> list of patterns


@functools.cache
def load_language(code: str) -> Language:
    if code not in LANGUAGES:
        raise ConfigError(f"unknown language {code!r}; valid: {', '.join(LANGUAGES)}")
    raw = json.loads(resources.files("chatfleet.bench").joinpath("data", f"{code}.json").read_text("utf-8"))
    words = {slot: raw[key] for slot, key in _SLOTS.items()}
    words["name"] = raw["names"]
    sentences = {k[: -len("_sentences")]: v for k, v in raw.items() if k.endswith("_sentences")}
    return Language(code, raw["labels"], words, sentences)


@functools.lru_cache(maxsize=1)
def _card_template() -> jinja2.Template:
    text = resources.files("chatfleet.bench").joinpath("templates", "card.j2").read_text("utf-8")
    return jinja2.Environment(keep_trailing_newline=True, autoescape=False).from_string(text)


@dataclass(frozen=True)
class Card:
    """A character: the system prompt every conversation with it starts with."""

    character_id: int
    name: str
    language: str
    text: str
    tokens: int


class _Filler:
    def __init__(self, lang: Language, rng: random.Random, name: str, user: str) -> None:
        self.lang, self.rng, self.name, self.user = lang, rng, name, user

    def sentence(self, kind: str) -> str:
        w, rng = self.lang.words, self.rng
        fields = {slot: rng.choice(w[slot]) for slot in _SLOTS}
        fields["trait2"] = rng.choice(w["trait"])
        return rng.choice(self.lang.sentences[kind]).format(name=self.name, user=self.user, **fields)

    def grow(self, kind: str, counter: TokenCounter, target: int, at_least: int = 1) -> tuple[str, int]:
        """Sentences of one kind until their summed token count reaches ``target``."""
        parts: list[str] = []
        total = 0
        while total < target or len(parts) < at_least:
            s = self.sentence(kind)
            n = counter.count(s) + 1
            if len(parts) >= at_least and total + n / 2 > target:
                break  # the next sentence would overshoot more than stopping undershoots
            parts.append(s)
            total += n
        return " ".join(parts), total


def make_card(character_id: int, lang_code: str, target_tokens: int, counter: TokenCounter, seed: int) -> Card:
    """A persona card of about ``target_tokens`` tokens: 35% personality, 25% scenario, 40% examples."""
    lang = load_language(lang_code)
    rng = random.Random(f"card:{seed}:{character_id}")
    name = rng.choice(lang.words["name"])
    filler = _Filler(lang, rng, name, lang.labels["user"])
    # The layout itself (labels, name lines) takes about 8 tokens plus 6 per example exchange.
    body = max(8, target_tokens - 8)
    personality, _ = filler.grow("personality", counter, int(body * 0.35))
    scenario, _ = filler.grow("scenario", counter, int(body * 0.25))
    examples: list[tuple[str, str]] = []
    used = 0
    while True:
        u, c = filler.sentence("user"), filler.sentence("reply")
        n = counter.count(u) + counter.count(c) + 6
        if examples and used + n / 2 > body * 0.40:
            break
        examples.append((u, c))
        used += n
    text = _card_template().render(
        labels=lang.labels, name=name, role=rng.choice(lang.words["role"]),
        personality=personality, scenario=scenario, examples=examples,
    )
    return Card(character_id, name, lang_code, text, counter.count(text))


def make_turn_text(kind: str, card: Card, target_tokens: int, counter: TokenCounter, rng: random.Random) -> str:
    """A user turn (``kind='user'``) or a scripted reply (``'reply'``) of about ``target_tokens``."""
    lang = load_language(card.language)
    filler = _Filler(lang, rng, card.name, lang.labels["user"])
    text, _ = filler.grow(kind, counter, target_tokens)
    return text
