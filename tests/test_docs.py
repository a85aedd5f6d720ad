"""The README's paths exist in the repository, and the architecture document lives there too."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()


def test_the_readme_points_inside_the_repository():
    links = re.findall(r"\]\(([^)]+)\)", README)
    assert "docs/architecture.md" in links
    assert not [p for p in re.findall(r"[`(]([./\w-]+\.md)[`)]", README) if p.startswith("..")]
    for link in links:
        if "://" not in link:
            assert (REPO / link).exists(), link


def test_every_repository_path_the_readme_names_exists():
    named = set(re.findall(r"`((?:benchmarks|docs|src|tests|\.ci)/[\w./-]+)`", README))
    assert named, "the README names no repository paths"
    missing = sorted(p for p in named if not (REPO / p).exists() and not p.startswith("benchmarks/results")
                     and not p.startswith("benchmarks/.venv"))
    assert not missing
