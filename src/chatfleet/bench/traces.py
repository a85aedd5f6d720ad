"""Traces: export a workload as OpenAI-messages JSONL; import it back, or import ShareGPT JSON.

One JSONL line per conversation: ``{"conv_id", "character_id", "messages": [system, user,
assistant, user, assistant, ...], "reply_tokens": [...], "think_time_s": [...]}``. On import,
missing reply lengths are counted from the assistant texts and missing think times are drawn
from the profile. A trace replays in order and wraps around when the run needs more chats.
"""

from __future__ import annotations

import json
import random
import zlib
from dataclasses import dataclass, field
from pathlib import Path

from chatfleet.bench.tokens import TokenCounter
from chatfleet.bench.workload import Conversation, Turn, Workload, WorkloadProfile
from chatfleet.errors import ConfigError


def export_jsonl(workload: Workload, n: int, path: str | Path) -> Path:
    """Write conversations 0..n-1 of ``workload`` (with scripted replies) as JSONL."""
    if not workload.scripted_replies:
        raise ConfigError("export needs a workload built with scripted_replies=True")
    path = Path(path)
    with path.open("w", encoding="utf-8") as f:
        for i in range(n):
            c = workload.conversation(i)
            msgs = c.messages(len(c.turns) - 1) + [{"role": "assistant", "content": c.turns[-1].reply or ""}]
            f.write(json.dumps({
                "conv_id": c.conv_id, "character_id": c.character_id, "messages": msgs,
                "reply_tokens": [t.reply_tokens for t in c.turns],
                "think_time_s": [t.think_time_s for t in c.turns],
            }, ensure_ascii=False) + "\n")
    return path


def _conversation(i: int, messages: list[dict], reply_tokens: list | None, think: list | None,
                  profile: WorkloadProfile, counter: TokenCounter, rng: random.Random, max_reply: int,
                  character_id: int | None = None) -> Conversation | None:
    system = ""
    rest = messages
    if rest and rest[0].get("role") == "system":
        system, rest = rest[0].get("content") or "", rest[1:]
    turns: list[Turn] = []
    k = 0
    while k < len(rest):
        m = rest[k]
        if m.get("role") != "user":
            k += 1
            continue
        reply = rest[k + 1].get("content") if k + 1 < len(rest) and rest[k + 1].get("role") == "assistant" else None
        t = len(turns)
        n_reply = int(reply_tokens[t]) if reply_tokens and t < len(reply_tokens) else (
            counter.count(reply) if reply else profile.reply_tokens.sample_int(rng))
        n_reply = max(1, min(n_reply, max_reply))
        th = float(think[t]) if think and t < len(think) else (0.0 if t == 0 else profile.think_time_s.sample(rng))
        user = m.get("content") or ""
        turns.append(Turn(user, counter.count(user), n_reply, th, reply))
        k += 2 if reply is not None else 1
    if not turns:
        return None
    cid = character_id if character_id is not None else zlib.crc32(system.encode()) % 1_000_000
    return Conversation(i, cid, system, counter.count(system) if system else 0, tuple(turns), profile.max_prompt_tokens)


@dataclass
class TraceWorkload:
    """A fixed list of conversations with the :class:`Workload` interface the loops use."""

    profile: WorkloadProfile
    seed: int
    counter: TokenCounter
    conversations: list[Conversation] = field(default_factory=list)
    scripted_replies: bool = True

    def conversation(self, i: int) -> Conversation:
        base = self.conversations[i % len(self.conversations)]
        return Conversation(i, base.character_id, base.system, base.system_tokens, base.turns, base.max_prompt_tokens)

    def first_think_time(self, i: int) -> float:
        return self.profile.think_time_s.sample(random.Random(f"first:{self.seed}:{i}"))


def import_jsonl(path: str | Path, profile: WorkloadProfile, counter: TokenCounter, seed: int = 0,
                 max_reply_tokens: int = 4096) -> TraceWorkload:
    rng = random.Random(f"trace:{seed}")
    convs: list[Conversation] = []
    for lineno, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            msgs = obj["messages"]
        except (ValueError, KeyError, TypeError):
            raise ConfigError(f"{path}:{lineno}: expected a JSON object with 'messages'") from None
        c = _conversation(len(convs), msgs, obj.get("reply_tokens"), obj.get("think_time_s"), profile, counter,
                          rng, max_reply_tokens, obj.get("character_id"))
        if c is not None:
            convs.append(c)
    if not convs:
        raise ConfigError(f"{path}: no conversation with a user turn")
    return TraceWorkload(profile, seed, counter, convs)


_SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant",
                   "assistant": "assistant", "system": "system"}


def import_sharegpt(path: str | Path, profile: WorkloadProfile, counter: TokenCounter, seed: int = 0,
                    max_reply_tokens: int = 1024, limit: int | None = None) -> TraceWorkload:
    """ShareGPT JSON: a list of ``{"conversations": [{"from": "human"|"gpt"|"system", "value": ...}]}``."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read ShareGPT file {path}: {e}") from None
    if not isinstance(data, list):
        raise ConfigError(f"{path}: ShareGPT data must be a JSON list of conversations")
    rng = random.Random(f"sharegpt:{seed}")
    convs: list[Conversation] = []
    for item in data:
        turns = item.get("conversations") if isinstance(item, dict) else None
        if not isinstance(turns, list):
            continue
        msgs = [{"role": _SHAREGPT_ROLES[t["from"]], "content": t.get("value", "")}
                for t in turns if isinstance(t, dict) and t.get("from") in _SHAREGPT_ROLES]
        c = _conversation(len(convs), msgs, None, None, profile, counter, rng, max_reply_tokens)
        if c is not None:
            convs.append(c)
        if limit is not None and len(convs) >= limit:
            break
    if not convs:
        raise ConfigError(f"{path}: no ShareGPT conversation with a human turn")
    return TraceWorkload(profile, seed, counter, convs)
