"""What a constrained request asks for, as a hashable value that keys the grammar cache."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

GrammarKind = Literal["json_schema", "lark"]


@dataclass(frozen=True)
class GrammarSpec:
    """A grammar the reply must follow: a JSON schema (as canonical JSON text) or a Lark grammar
    (llguidance's dialect, which may embed schemas with ``%json {...}``)."""

    kind: GrammarKind
    source: str

    def __post_init__(self) -> None:
        if self.kind not in ("json_schema", "lark"):
            raise ValueError(f"unknown grammar kind {self.kind!r}")

    @classmethod
    def json_schema(cls, schema: dict[str, object] | bool) -> GrammarSpec:
        """A spec for ``schema``; key order and spacing do not change the cache key."""
        return cls("json_schema", json.dumps(schema, sort_keys=True, separators=(",", ":"), ensure_ascii=False))


ANY_JSON_OBJECT = GrammarSpec.json_schema({"type": "object"})
