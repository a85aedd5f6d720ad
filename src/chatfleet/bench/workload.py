"""Role-play chat traffic: characters with persona cards, conversations with growing history.

Many conversations share one card (Zipf popularity). Each request carries the card, the whole
history and the new user turn, as chat apps send it. Conversation ``i`` of a workload is a pure
function of (profile, seed, i), so the same seed gives the same trace whatever the timing.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field, replace

from chatfleet.bench.dists import Dist, make, zipf_weights
from chatfleet.bench.personas import LANGUAGES, Card, make_card, make_turn_text
from chatfleet.bench.tokens import TOKENS_PER_MESSAGE, TOKENS_PER_PROMPT, TokenCounter
from chatfleet.errors import ConfigError


@dataclass(frozen=True)
class WorkloadProfile:
    """Distributions of a role-play workload; lengths in tokens of the target tokenizer."""

    name: str
    num_characters: int
    zipf_s: float
    card_tokens: Dist
    user_tokens: Dist
    reply_tokens: Dist  # forced: min_tokens = max_tokens
    turns: Dist  # turns per conversation
    think_time_s: Dist  # between a reply's end and the next user turn
    languages: tuple[tuple[str, float], ...] = (("en", 0.55), ("es", 0.15), ("de", 0.15), ("ru", 0.15))
    max_prompt_tokens: int = 32768  # older turns are dropped beyond this, as chat apps do

    def __post_init__(self) -> None:
        if self.num_characters < 1:
            raise ConfigError("a workload needs at least one character")
        if self.zipf_s < 0:
            raise ConfigError("zipf_s must be >= 0")
        for code, weight in self.languages:
            if code not in LANGUAGES:
                raise ConfigError(f"unknown language {code!r}; valid: {', '.join(LANGUAGES)}")
            if weight < 0:
                raise ConfigError("language weights must be >= 0")
        if not self.languages or sum(w for _, w in self.languages) <= 0:
            raise ConfigError("give at least one language with a positive weight")
        if self.max_prompt_tokens < 16:
            raise ConfigError("max_prompt_tokens must be >= 16")

    def with_overrides(self, **kw) -> WorkloadProfile:
        return replace(self, **{k: v for k, v in kw.items() if v is not None})


PROFILES: dict[str, WorkloadProfile] = {
    # A role-play service as its operators describe it: ~5.5K-token requests on average, ~9K at
    # p95, replies up to 300 tokens, people reading and typing between turns.
    "seed-roleplay": WorkloadProfile(
        name="seed-roleplay",
        num_characters=200,
        zipf_s=1.0,
        card_tokens=make("lognormal", mean=3000, sigma=0.25, min=600, max=5000),
        user_tokens=make("lognormal", mean=40, sigma=0.7, min=4, max=300),
        reply_tokens=make("uniform", low=120, high=300),
        turns=make("uniform", low=10, high=30),
        think_time_s=make("lognormal", mean=20.0, sigma=0.6, min=3, max=120),
        max_prompt_tokens=16384,
    ),
    # The same shape scaled for the `small` model on 2 CPU cores: a knee within minutes.
    "cpu-roleplay": WorkloadProfile(
        name="cpu-roleplay",
        num_characters=12,
        zipf_s=1.0,
        card_tokens=make("lognormal", mean=160, sigma=0.3, min=80, max=320),
        user_tokens=make("lognormal", mean=14, sigma=0.4, min=4, max=40),
        reply_tokens=make("uniform", low=6, high=14),
        turns=make("uniform", low=3, high=7),
        think_time_s=make("lognormal", mean=0.8, sigma=0.5, min=0.2, max=3.0),
        max_prompt_tokens=2048,
    ),
    # Users who pause (for `small` on CPU cores): longer cards and histories, and pauses several
    # times a turn's own time (lognormal: most people answer within seconds, some leave for a
    # minute), so the live chats' working set at the knee is several times a scarce device pool
    # (the demo's 2,048 tokens) and a returning turn finds its history only if nothing evicted it.
    "long-session": WorkloadProfile(
        name="long-session",
        num_characters=24,
        zipf_s=0.8,
        card_tokens=make("lognormal", mean=420, sigma=0.25, min=200, max=800),
        user_tokens=make("lognormal", mean=32, sigma=0.6, min=6, max=120),
        reply_tokens=make("uniform", low=10, high=20),
        turns=make("uniform", low=6, high=14),
        think_time_s=make("lognormal", mean=2.5, sigma=0.9, min=0.3, max=60.0),
        max_prompt_tokens=1536,
    ),
}


def get_profile(name: str) -> WorkloadProfile:
    if name not in PROFILES:
        raise ConfigError(f"unknown workload profile {name!r}; valid: {', '.join(PROFILES)}")
    return PROFILES[name]


@dataclass(frozen=True)
class Turn:
    user: str
    user_tokens: int
    reply_tokens: int
    think_time_s: float  # wait before this turn is sent (after the previous reply's end)
    reply: str | None = None  # scripted or imported assistant text (used by traces)


@dataclass(frozen=True)
class Conversation:
    conv_id: int
    character_id: int
    system: str  # the persona card
    system_tokens: int
    turns: tuple[Turn, ...]
    max_prompt_tokens: int = 32768

    def messages(self, turn_index: int, replies: list[str] | None = None) -> list[dict]:
        """The request for ``turn_index``: card, history (``replies`` or the scripted ones), new turn.

        Oldest turn pairs are dropped while the estimate exceeds ``max_prompt_tokens``.
        """
        replies = replies if replies is not None else [t.reply or "" for t in self.turns[:turn_index]]
        if len(replies) < turn_index:
            raise ValueError(f"turn {turn_index} needs {turn_index} earlier replies, got {len(replies)}")
        first = 0
        while first < turn_index and self.prompt_tokens(turn_index, first) > self.max_prompt_tokens:
            first += 1
        msgs = [{"role": "system", "content": self.system}] if self.system else []
        for i in range(first, turn_index):
            msgs.append({"role": "user", "content": self.turns[i].user})
            msgs.append({"role": "assistant", "content": replies[i]})
        msgs.append({"role": "user", "content": self.turns[turn_index].user})
        return msgs

    def prompt_tokens(self, turn_index: int, first: int = 0) -> int:
        """Estimated prompt tokens of a turn, counting earlier replies at their forced length."""
        n = TOKENS_PER_PROMPT + TOKENS_PER_MESSAGE + self.system_tokens
        for t in self.turns[first:turn_index]:
            n += 2 * TOKENS_PER_MESSAGE + t.user_tokens + t.reply_tokens
        return n + TOKENS_PER_MESSAGE + self.turns[turn_index].user_tokens


@dataclass
class Workload:
    """Seeded conversation source for one profile; cards are built once with the counter."""

    profile: WorkloadProfile
    seed: int
    counter: TokenCounter
    scripted_replies: bool = False  # also write assistant texts (trace export, --history trace)
    cards: list[Card] = field(init=False)
    _weights: list[float] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        p = self.profile
        rng = random.Random(f"cards:{self.seed}")
        codes, lang_w = zip(*p.languages, strict=True)
        self.cards = []
        for cid in range(p.num_characters):
            lang = rng.choices(codes, weights=lang_w)[0]
            target = p.card_tokens.sample_int(rng)
            self.cards.append(make_card(cid, lang, target, self.counter, self.seed))
        self._weights = zipf_weights(p.num_characters, p.zipf_s)

    def conversation(self, i: int) -> Conversation:
        p = self.profile
        rng = random.Random(f"conv:{self.seed}:{i}")
        card = rng.choices(self.cards, weights=self._weights)[0]
        n_turns = max(1, p.turns.sample_int(rng))
        turns = []
        for t in range(n_turns):
            user_target = max(1, p.user_tokens.sample_int(rng))
            user = make_turn_text("user", card, user_target, self.counter, rng)
            reply_tokens = max(1, p.reply_tokens.sample_int(rng))
            think = 0.0 if t == 0 else p.think_time_s.sample(rng)
            reply = make_turn_text("reply", card, reply_tokens, self.counter, rng) if self.scripted_replies else None
            turns.append(Turn(user, self.counter.count(user), reply_tokens, think, reply))
        return Conversation(i, card.character_id, card.text, card.tokens, tuple(turns), p.max_prompt_tokens)

    def join_turn(self, conv: Conversation) -> int:
        """The turn at which a chat already in progress is joined (uniform over its turns)."""
        return random.Random(f"join:{self.seed}:{conv.conv_id}").randrange(len(conv.turns))

    def scripted_history(self, conv: Conversation, turns: int) -> list[str]:
        """Assistant texts for the first ``turns`` turns of ``conv`` (a joined chat's history): the
        turn's scripted reply where it has one, else text of its forced reply length."""
        card = self.cards[conv.character_id]
        out = []
        for t, turn in enumerate(conv.turns[:turns]):
            rng = random.Random(f"reply:{self.seed}:{conv.conv_id}:{t}")
            out.append(turn.reply if turn.reply is not None
                       else make_turn_text("reply", card, turn.reply_tokens, self.counter, rng))
        return out

    def first_think_time(self, i: int) -> float:
        """Think time before a replacement conversation's first turn (a new user arrives)."""
        return self.profile.think_time_s.sample(random.Random(f"first:{self.seed}:{i}"))
