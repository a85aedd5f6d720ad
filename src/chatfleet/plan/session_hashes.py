"""Block hashes carried from a conversation's turn to its next one (the planner's shortcut).

A returning turn's prompt starts with the previous turn's prompt (the history grows at its end),
so the engine would hash the same blocks again: thousands of BLAKE2b digests per request with
long histories. The simulated replica keeps each session's last finished request (tokens and the
``BlockHash`` values the engine computed for it) and hands the new request the hashes of the
whole blocks both share, compared token by token: the values are those the engine would compute
(the same function of the same tokens, no salt), it only skips recomputing them. Sharing the
very objects also lets the pool's lookup confirm a hit by identity. A conversation's first turn
takes them the same way from the latest request of its prefix group (the chats of one character
share its card), if the caller names one.
"""

from __future__ import annotations

from collections import OrderedDict

from chatfleet.engine.block_hash import BlockHash
from chatfleet.engine.request import Request

MAX_SESSIONS = 1024  # sessions (and prefix groups) remembered, oldest dropped: enough for the live chats of a replica
_GROUP = "\x00group:"  # prefix groups' keys, apart from sessions'


class SessionHashes:
    def __init__(self, block_size: int, max_sessions: int = MAX_SESSIONS) -> None:
        self.block_size = block_size
        self.max_sessions = max_sessions
        self._last: OrderedDict[str, tuple[list[int], list[int], list[BlockHash]]] = OrderedDict()
        self.reused_blocks = 0

    def keep(self, session: str, request: Request | None, prefix_group: str | None = None) -> None:
        """Remember a finished request of ``session`` (its tokens and block hashes), also as the
        latest of ``prefix_group`` (requests that start alike: one character's card)."""
        if request is None or request.cache_salt is not None or not request.block_hashes:
            return
        entry = (request.prompt_token_ids, request.output_token_ids, request.block_hashes)
        for key in [session] if prefix_group is None else [session, _GROUP + prefix_group]:
            self._last[key] = entry
            self._last.move_to_end(key)
        while len(self._last) > self.max_sessions:
            self._last.popitem(last=False)

    def prime(self, session: str, request: Request | None, prefix_group: str | None = None) -> None:
        """Give a new request of ``session`` the hashes of the whole blocks it shares with the
        session's previous request, or where the session has none yet, with the latest request
        of ``prefix_group`` (before the engine hashes anything of it)."""
        if request is None or request.cache_salt is not None or request.block_hashes:
            return
        last = self._last.get(session)
        if last is None and prefix_group is not None:
            last = self._last.get(_GROUP + prefix_group)
        if last is None:
            return
        old_prompt, old_output, hashes = last
        n = _shared_blocks(request.prompt_token_ids, old_prompt, old_output, self.block_size,
                           min(len(hashes), len(request.prompt_token_ids) // self.block_size))
        if n:
            request.block_hashes = hashes[:n]
            self.reused_blocks += n


def _shared_blocks(prompt: list[int], old_prompt: list[int], old_output: list[int], bs: int, limit: int) -> int:
    """How many leading whole blocks (at most ``limit``) ``prompt`` shares with ``old_prompt +
    old_output``. A chat's next prompt most often repeats the old prompt and then diverges (the
    reply comes back behind a template's header), so that guess is tested first with one
    comparison; otherwise the divergence is bisected, each step comparing only the blocks between
    the bounds (so about two prompt lengths of tokens in all)."""
    p = len(old_prompt)
    guess = min(limit, p // bs)
    end = guess * bs
    if prompt[:end] == old_prompt[:end]:
        n = guess
        while n < limit:  # past the old prompt: block by block (usually one, which differs)
            s, e = n * bs, (n + 1) * bs
            old = old_prompt[s:e] if e <= p else old_prompt[s:] + old_output[max(0, s - p):e - p]
            if prompt[s:e] != old:
                break
            n += 1
        return n
    lo, hi = 0, guess  # the first lo blocks agree, the first hi do not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if prompt[lo * bs:mid * bs] == old_prompt[lo * bs:mid * bs]:
            lo = mid
        else:
            hi = mid
    return lo
