"""A deterministic fake runner: the "model" is a hash of the context it reads back from its KV.

Each chunk's tokens are written into the slots its block table names; sampling reads the whole
context back from those slots and hashes it. A wrong block table, a prefix hit with foreign
contents or a block reused while still in use therefore changes the output, so greedy
equivalence tests catch KV bugs without torch. Reading a slot that holds the wrong position
raises at once. A host tier is a second slot array: KV transfers copy whole blocks between the
two (stores before loads), so a wrong transfer shows in the contents as well. An optional cost
model advances a virtual clock (for capacity planning).

``check_contents=False`` is the planner's fast mode: no slot arrays, no context read-back; a
sampled token is a hash of (request id, position), so outputs stay deterministic and the plans
(what the scheduler decides) are the same as with the checks on when lengths are forced.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable

import numpy as np

from chatfleet.engine.outputs import (
    NO_TRANSFERS,
    KVTransfer,
    RunnerOutput,
    SampledToken,
    ScheduledChunk,
    SchedulerOutput,
    TokenLogprob,
    TransferDirection,
    TransferStats,
)
from chatfleet.errors import KVIntegrityError


def _digest(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


class SimRunner:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        vocab_size: int = 4096,
        max_model_len: int = 16384,
        cost_model: Callable[[SchedulerOutput], float] | None = None,
        num_host_blocks: int = 0,
        check_contents: bool = True,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.cost_model = cost_model
        self.virtual_time = 0.0  # seconds the cost model charged so far
        self.num_steps = 0
        self.check_contents = check_contents
        self._bases: dict[str, int] = {}  # fast mode: per-request hash base
        rows = num_blocks if check_contents else 0
        self._tokens = np.full((rows, block_size), -1, dtype=np.int64)
        self._positions = np.full((rows, block_size), -1, dtype=np.int64)
        self._rngs: dict[str, random.Random] = {}
        self.num_host_blocks = num_host_blocks
        host_rows = num_host_blocks if check_contents else 0
        self._host_tokens = np.full((host_rows, block_size), -1, dtype=np.int64)
        self._host_positions = np.full((host_rows, block_size), -1, dtype=np.int64)

    def execute(self, plan: SchedulerOutput) -> RunnerOutput:
        self.forget(plan.finished_request_ids)
        if not self.check_contents:
            return self._execute_fast(plan)
        stats = self._transfer(plan.kv_transfers) if plan.kv_transfers else NO_TRANSFERS
        sampled: dict[str, SampledToken] = {}
        prompt_logprobs: dict[str, list[TokenLogprob]] = {}
        for chunk in plan.chunks:
            self._write(chunk)
            if chunk.want_prompt_logprobs:
                prompt_logprobs[chunk.request_id] = self._prompt_logprobs(chunk)
            if chunk.sample:
                sampled[chunk.request_id] = self._sample(chunk)
        self.num_steps += 1
        if self.cost_model is not None:
            self.virtual_time += self.cost_model(plan)
        return RunnerOutput(sampled, prompt_logprobs, stats)

    def _execute_fast(self, plan: SchedulerOutput) -> RunnerOutput:
        stats = NO_TRANSFERS
        if plan.kv_transfers:
            stored = sum(t.num_blocks for t in plan.kv_transfers if t.direction == TransferDirection.STORE)
            loaded = sum(t.num_blocks for t in plan.kv_transfers) - stored
            per_block = self.block_size * 16
            stats = TransferStats(stored, loaded, stored * per_block, loaded * per_block)
        sampled: dict[str, SampledToken] = {}
        for chunk in plan.chunks:
            if chunk.sample:
                sampled[chunk.request_id] = SampledToken(self.fast_token(
                    chunk.request_id, chunk.context_length, chunk.eos_token_id, chunk.sampling_params.stop_token_ids))
        self.num_steps += 1
        if self.cost_model is not None:
            self.virtual_time += self.cost_model(plan)
        return RunnerOutput(sampled, {}, stats)

    def fast_token(self, request_id: str, context_length: int, eos_token_id: int | None,
                   stop_token_ids: tuple[int, ...]) -> int:
        """Fast mode's sampled token after ``context_length`` tokens of the request."""
        base = self._bases.get(request_id)
        if base is None:
            base = self._bases[request_id] = _digest(request_id.encode())
        token = (base + context_length * 0x9E3779B1) % self.vocab_size
        if token == eos_token_id or token in stop_token_ids:
            token = (token + 1) % self.vocab_size
        return int(token)

    def fast_tokens(self, request_id: str, first_context_length: int, n: int, eos_token_id: int | None,
                    stop_token_ids: tuple[int, ...]) -> list[int]:
        """``fast_token`` after ``first_context_length``, ``first_context_length + 1``, ... (``n`` of them)."""
        base = self._bases.get(request_id)
        if base is None:
            base = self._bases[request_id] = _digest(request_id.encode())
        v = self.vocab_size
        tokens = [(base + c * 0x9E3779B1) % v for c in range(first_context_length, first_context_length + n)]
        if eos_token_id is not None or stop_token_ids:
            banned = {eos_token_id, *stop_token_ids}
            tokens = [(t + 1) % v if t in banned else t for t in tokens]
        return tokens

    def forget(self, request_ids: list[str]) -> None:
        """Drop the per-request state of finished requests (a plan names them once)."""
        for rid in request_ids:
            self._rngs.pop(rid, None)
            self._bases.pop(rid, None)

    def note_steps(self, costs: list[float]) -> None:
        """Steps run without ``execute`` (``engine/decode_span.py``), each charged its cost."""
        self.num_steps += len(costs)
        for c in costs:
            self.virtual_time += c

    def _transfer(self, transfers: list[KVTransfer]) -> TransferStats:
        stored = loaded = 0
        for t in sorted(transfers, key=lambda t: t.direction != TransferDirection.STORE):
            d, h = list(t.device_block_ids), list(t.host_block_ids)
            if max(h) >= self.num_host_blocks or max(d) >= self.num_blocks:
                raise KVIntegrityError(f"KV transfer names a block out of range: {t}")
            if t.direction == TransferDirection.STORE:
                self._host_tokens[h] = self._tokens[d]
                self._host_positions[h] = self._positions[d]
                stored += len(d)
            else:
                self._tokens[d] = self._host_tokens[h]
                self._positions[d] = self._host_positions[h]
                loaded += len(d)
        per_block = self.block_size * 16  # a nominal size: one K and one V word per token
        return TransferStats(stored, loaded, stored * per_block, loaded * per_block)

    def _slots(self, table: list[int], start: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        pos = np.arange(start, end)
        if end > len(table) * self.block_size:
            raise KVIntegrityError(f"block table of {len(table)} blocks cannot hold position {end - 1}")
        return np.asarray(table, dtype=np.int64)[pos // self.block_size], pos % self.block_size

    def _write(self, chunk: ScheduledChunk) -> None:
        blocks, offsets = self._slots(chunk.block_table, chunk.start_position, chunk.context_length)
        self._tokens[blocks, offsets] = chunk.token_ids
        self._positions[blocks, offsets] = np.arange(chunk.start_position, chunk.context_length)

    def _read_context(self, chunk: ScheduledChunk) -> np.ndarray:
        blocks, offsets = self._slots(chunk.block_table, 0, chunk.context_length)
        positions = self._positions[blocks, offsets]
        if not np.array_equal(positions, np.arange(chunk.context_length)):
            bad = int(np.flatnonzero(positions != np.arange(chunk.context_length))[0])
            raise KVIntegrityError(
                f"{chunk.request_id}: KV slot for position {bad} holds position {int(positions[bad])}"
            )
        return self._tokens[blocks, offsets]

    def _sample(self, chunk: ScheduledChunk) -> SampledToken:
        context = self._read_context(chunk)
        h = _digest(context.tobytes())
        params = chunk.sampling_params
        token = h % self.vocab_size
        if not params.greedy:
            rng = self._rngs.get(chunk.request_id)
            if rng is None:
                seed = params.seed if params.seed is not None else random.getrandbits(64)
                rng = self._rngs[chunk.request_id] = random.Random(seed)
            token = (token + rng.randrange(self.vocab_size)) % self.vocab_size
        banned = set()
        if chunk.eos_token_id is not None and (params.ignore_eos or chunk.num_output_tokens < params.min_tokens):
            banned.add(chunk.eos_token_id)
        if chunk.num_output_tokens < params.min_tokens:
            banned.update(params.stop_token_ids)
        while token in banned:
            token = (token + 1) % self.vocab_size
        logprob = None
        if params.logprobs is not None:
            logprob = self._fake_logprob(token, h, params.logprobs)
        return SampledToken(int(token), logprob)

    def _fake_logprob(self, token: int, h: int, k: int) -> TokenLogprob:
        lp = -((h >> 16) % 1000) / 100.0
        top = [(token, lp)] + [((token + i) % self.vocab_size, lp - i) for i in range(1, k)]
        return TokenLogprob(int(token), lp, top[:k])

    def _prompt_logprobs(self, chunk: ScheduledChunk) -> list[TokenLogprob]:
        """One entry per chunk token that has a predecessor (a function of the pair)."""
        context = self._read_context(chunk)
        k = chunk.sampling_params.prompt_logprobs or 0
        first = max(chunk.start_position, 1)
        out = []
        for pos in range(first, chunk.context_length):
            pair = context[pos - 1 : pos + 1].tobytes() + pos.to_bytes(4, "little")
            out.append(self._fake_logprob(int(context[pos]), _digest(pair), k))
        return out


BYTE_VOCAB_SIZE = 258  # 256 bytes, <|im_end|> (eos), <|endoftext|>


def make_byte_tokenizer():
    """A model-free ``ChatTokenizer``: token id = UTF-8 byte value, plus two stop tokens.

    For the SimRunner (tests, planning): every text encodes, multi-byte characters span tokens.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    from chatfleet.engine.tokenizer import ChatTokenizer

    # GPT-2's reversible byte -> printable character map, so the BPE vocab is byte-indexed.
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    backend = Tokenizer(models.BPE({chars[b]: b for b in range(256)}, []))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken("<|im_end|>", special=True), AddedToken("<|endoftext|>", special=True)])
    template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    return ChatTokenizer(backend, chat_template=template, eos_token="<|im_end|>")
