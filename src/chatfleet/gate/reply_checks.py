"""Failure checks on one generated reply: language mismatch, termination, looping.

- Language: the reply must be in the conversation's language. A script test first (Cyrillic
  for Russian, Latin for the others), then, for replies long enough to judge, ``langid``
  (Lui & Baldwin 2012; the model ships inside the package, nothing is downloaded) restricted
  to the languages the workload uses.
- Termination: the reply hit ``max_tokens`` instead of stopping by itself.
- Looping: some token n-gram repeats many times (on token ids, so it is tokenizer-exact).
"""

from __future__ import annotations

import contextlib
import functools
import os
import pickle
import unicodedata
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

from chatfleet.bench.personas import LANGUAGES

SCRIPTS = {"ru": "CYRILLIC"}  # others: LATIN
MIN_LANGID_CHARS = 24  # shorter replies: script test only


@dataclass(frozen=True)
class ReplyFailures:
    language_mismatch: bool
    hit_max_tokens: bool
    looping: bool
    detected_language: str | None

    def to_dict(self) -> dict:
        return asdict(self)


def script_share(text: str, script: str) -> float:
    """Share of the letters of ``text`` whose Unicode name starts with ``script``."""
    letters = [ch for ch in text if ch.isalpha()]
    if not letters:
        return 0.0
    return sum(1 for ch in letters if unicodedata.name(ch, "").startswith(script)) / len(letters)


_IDENT_FIELDS = ("nb_ptc", "nb_pc", "nb_numfeats", "nb_classes", "tk_nextmove", "tk_output")


@functools.lru_cache(maxsize=1)
def _identifier():
    """langid's identifier restricted to the workload's languages.

    Unpacking langid's shipped model takes seconds (millions of floats from a compressed
    pickle), so the restricted model is kept once in the chatfleet cache folder.
    """
    from langid.langid import LanguageIdentifier

    # The root of chatfleet.engine.builtin_models.tiny.cache_root(), without importing torch through it.
    root = Path(os.environ.get("CHATFLEET_CACHE") or Path.home() / ".cache" / "chatfleet")
    path = root / "langid" / f"ident-{'-'.join(LANGUAGES)}-v1.pkl"
    try:
        with path.open("rb") as f:
            fields = pickle.load(f)
        return LanguageIdentifier(*fields, norm_probs=True)
    except (OSError, pickle.UnpicklingError, EOFError, TypeError, ValueError):
        pass
    from langid.langid import model

    ident = LanguageIdentifier.from_modelstring(model, norm_probs=True)
    ident.set_languages(list(LANGUAGES))
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        with tmp.open("wb") as f:
            pickle.dump(tuple(getattr(ident, k) for k in _IDENT_FIELDS), f, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(tmp, path)  # atomic: a concurrent reader sees the old file or the whole new one
    return ident


def detect_language(text: str) -> str | None:
    """The most likely of the workload's languages, or None for text too short to judge."""
    letters = sum(1 for ch in text if ch.isalpha())
    if letters < MIN_LANGID_CHARS:
        return None
    return _identifier().classify(text)[0]


def language_mismatch(text: str, expected: str) -> tuple[bool, str | None]:
    """(mismatch, detected). A reply with no letters at all counts as a mismatch."""
    script = SCRIPTS.get(expected, "LATIN")
    if script_share(text, script) < 0.5:
        return True, None
    detected = detect_language(text)
    return (detected is not None and detected != expected), detected


def is_looping(token_ids: list[int], n: int = 4, max_repeats: int = 4) -> bool:
    """True when some ``n``-gram of token ids occurs more than ``max_repeats`` times."""
    if len(token_ids) < n * (max_repeats + 1):
        return False
    grams = Counter(tuple(token_ids[i:i + n]) for i in range(len(token_ids) - n + 1))
    return max(grams.values()) > max_repeats


def check_reply(text: str, token_ids: list[int], finish_reason: str | None, expected_language: str) -> ReplyFailures:
    mismatch, detected = language_mismatch(text, expected_language)
    return ReplyFailures(mismatch, finish_reason == "length", is_looping(token_ids), detected)
