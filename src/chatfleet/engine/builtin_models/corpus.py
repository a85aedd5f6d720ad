"""The multilingual text the tiny models' tokenizer is trained on (shipped in ``corpus/*.txt``)."""

from __future__ import annotations

from importlib import resources

CORPUS_PACKAGE = "chatfleet.engine.builtin_models"


def corpus_files() -> dict[str, str]:
    """Name (e.g. ``"ru"``) -> text of every shipped corpus file, sorted by name."""
    folder = resources.files(CORPUS_PACKAGE).joinpath("corpus")
    out: dict[str, str] = {}
    for entry in sorted(folder.iterdir(), key=lambda e: e.name):
        if entry.name.endswith(".txt"):
            out[entry.name[: -len(".txt")]] = entry.read_text(encoding="utf-8")
    return out


def corpus_texts() -> list[str]:
    """Every corpus file's text, in a fixed order (tokenizer training input)."""
    return list(corpus_files().values())
