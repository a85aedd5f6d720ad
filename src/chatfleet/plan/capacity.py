"""How many conversations a KV pool holds: a distribution of live-chat context lengths.

A live chat keeps its whole context (card, history, the reply being written) in KV while it is
being served, and its prefix cached between turns. ``LengthDistribution`` is a sample of such
contexts: from a bench workload profile (a random turn of a random conversation, as a snapshot
of live chats would find them) or from a stated mean and p95 (a lognormal through both).
``fit(spec, pool_bytes, lengths)`` counts chats at the mean and at the p95 length, with block
rounding and sliding windows (``KVCacheSpec.bytes_for_request``), and no prefix shared between
chats (a worst case: chats of one character share its card).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from chatfleet.bench.tokens import TOKENS_PER_MESSAGE, TOKENS_PER_PROMPT
from chatfleet.bench.workload import WorkloadProfile
from chatfleet.engine.kv.spec import KVCacheSpec
from chatfleet.errors import ConfigError


@dataclass(frozen=True)
class LengthDistribution:
    """Context lengths (tokens) of live chats; ``source`` says where they came from."""

    samples: tuple[int, ...]
    source: str

    def __post_init__(self) -> None:
        if not self.samples or min(self.samples) < 1:
            raise ConfigError("a length distribution needs positive samples")

    @property
    def mean(self) -> float:
        return sum(self.samples) / len(self.samples)

    def quantile(self, q: float) -> int:
        s = sorted(self.samples)
        return s[min(len(s) - 1, int(q * len(s)))]

    @property
    def p95(self) -> int:
        return self.quantile(0.95)


def lengths_from_profile(profile: WorkloadProfile, n: int = 4000, seed: int = 0) -> LengthDistribution:
    """Contexts of live chats of ``profile``: a random turn of each sampled conversation, its
    prompt (older turns dropped beyond ``max_prompt_tokens``, as the workload does) plus its reply."""
    rng = random.Random(f"lengths:{seed}")
    out = []
    for _ in range(n):
        card = profile.card_tokens.sample_int(rng)
        turns = max(1, profile.turns.sample_int(rng))
        pairs = [(max(1, profile.user_tokens.sample_int(rng)), max(1, profile.reply_tokens.sample_int(rng)))
                 for _ in range(turns)]
        t = rng.randrange(turns)
        history = [2 * TOKENS_PER_MESSAGE + u + r for u, r in pairs[:t]]
        head = TOKENS_PER_PROMPT + TOKENS_PER_MESSAGE + card + TOKENS_PER_MESSAGE + pairs[t][0]
        while history and head + sum(history) > profile.max_prompt_tokens:
            history.pop(0)
        out.append(head + sum(history) + pairs[t][1])
    return LengthDistribution(tuple(out), f"profile {profile.name} ({n} live chats sampled)")


def lengths_from_mean_p95(mean: float, p95: float, n: int = 4000, seed: int = 0) -> LengthDistribution:
    """A lognormal with this mean and 95th percentile (p95 must exceed the mean)."""
    if not 0 < mean < p95:
        raise ConfigError(f"lengths need 0 < mean < p95, got mean={mean} p95={p95}")
    # mean = m * exp(s^2/2), p95 = m * exp(1.645 s)  =>  log(p95/mean) = 1.645 s - s^2/2
    target = math.log(p95 / mean)
    if target > 1.645**2 / 2:
        raise ConfigError("p95 is too far above the mean for a lognormal")
    sigma = 1.645 - math.sqrt(1.645**2 - 2 * target)
    mu = math.log(mean) - sigma**2 / 2
    rng = random.Random(f"lengths:{seed}")
    samples = tuple(max(1, round(rng.lognormvariate(mu, sigma))) for _ in range(n))
    return LengthDistribution(samples, f"lognormal mean {mean:g} p95 {p95:g}")


@dataclass(frozen=True)
class ChatFit:
    """Chats of the mean and of the p95 length a pool of ``pool_bytes`` holds."""

    pool_bytes: int
    bytes_at_mean: int
    bytes_at_p95: int
    chats_at_mean: int
    chats_at_p95: int


def fit(spec: KVCacheSpec, pool_bytes: int, lengths: LengthDistribution) -> ChatFit:
    at_mean = spec.bytes_for_request(round(lengths.mean))
    at_p95 = spec.bytes_for_request(lengths.p95)
    return ChatFit(pool_bytes, at_mean, at_p95, pool_bytes // at_mean, pool_bytes // at_p95)
