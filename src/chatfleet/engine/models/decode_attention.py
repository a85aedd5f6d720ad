"""Single-token queries (decodes) over the paged cache, in groups of similar context length.

Decodes of one group run as one padded gather of their keys, one batched matmul for the
scores and, on CPU, ``embedding_bag`` weighted sums of the value rows read in place (no copy
of V); elsewhere (and for an FP8 cache) a gather of V and a second batched matmul. Every sequence of a group is
padded to the group's longest context, so the runner sorts decodes by context length and
``group_decodes`` starts a new group where padding would cost more than ``DECODE_PAD_LIMIT``
tokens: a batch of 500-token chats and one 8,000-token chat does not pad every chat to 8,000.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from chatfleet.engine.models.fp8_cast import fp8_placed, placed_down
from chatfleet.engine.models.workspace import Workspace, gather_blocks

DECODE_PAD_LIMIT = 2048  # padded tokens a group may carry (a group costs about 1,000 tokens' work)


@dataclass
class DecodeGroup:
    """Decodes ``[start, start + count)`` of the step, padded to ``max_blocks`` blocks each."""

    start: int
    count: int
    max_blocks: int
    block_size: int
    block_ids: torch.Tensor  # [count * max_blocks] long, row-major, padded with a valid block
    mask: torch.Tensor  # [count, max_blocks * block_size] bool, True: attend
    _bias: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)
    _bags: dict[tuple[int, int, int], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict, repr=False)

    @property
    def span(self) -> int:
        return self.max_blocks * self.block_size

    def bias(self, num_kv_heads: int) -> torch.Tensor:
        """Additive float32 mask [num_kv_heads * count, 1, span] (0 or -inf), built once per step."""
        bias = self._bias.get(num_kv_heads)
        if bias is None:
            zeros = torch.zeros(self.mask.shape, dtype=torch.float32, device=self.mask.device)
            bias = zeros.masked_fill_(~self.mask, float("-inf")).repeat(num_kv_heads, 1).unsqueeze(1)
            self._bias[num_kv_heads] = bias
        return bias

    def bags(self, group: int, num_kv_heads: int, slots_per_head: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``embedding_bag`` indices [num_kv_heads * count * group * span] and offsets, one bag per
        (kv head, sequence, query head of the kv group) over the cache slots of the sequence's span,
        as rows of the whole cache viewed [num_kv_heads * slots_per_head, D]: one bag call per layer."""
        key = (group, num_kv_heads, slots_per_head)
        bags = self._bags.get(key)
        if bags is None:
            d, bs, span = self.count, self.block_size, self.span
            ids = self.block_ids.view(1, d, self.max_blocks, 1) * bs
            heads = torch.arange(0, num_kv_heads * slots_per_head, slots_per_head, device=ids.device)
            slots = (ids + heads.view(-1, 1, 1, 1) + torch.arange(bs, device=ids.device)).view(num_kv_heads, d, 1, span)
            index = slots.expand(num_kv_heads, d, group, span).reshape(-1)
            offsets = torch.arange(0, index.numel(), span, device=ids.device)
            bags = self._bags[key] = (index, offsets)
        return bags


def group_decodes(num_blocks: list[int], block_size: int, pad_limit: int = DECODE_PAD_LIMIT) -> list[range]:
    """Split decodes (in the given order) into contiguous groups padding at most ``pad_limit`` tokens."""
    groups: list[range] = []
    start = longest = total = 0
    for i, n in enumerate(num_blocks):
        longest_if, total_if = max(longest, n), total + n
        if i > start and (longest_if * (i - start + 1) - total_if) * block_size > pad_limit:
            groups.append(range(start, i))
            start, longest_if, total_if = i, n, n
        longest, total = longest_if, total_if
    if num_blocks:
        groups.append(range(start, len(num_blocks)))
    return groups


def build_decode_groups(context_lens: list[int], block_tables: list[list[int]], block_size: int,
                        device: torch.device | str, pad_limit: int = DECODE_PAD_LIMIT,
                        window: int | None = None) -> list[DecodeGroup]:
    """``context_lens[i]`` counts decode i's own new token; tables may be longer than needed.

    With a sliding ``window`` only the blocks holding the last ``window`` positions are read
    (entries of the table before them are never touched: they may have been released).
    """
    first = [0 if window is None else max(0, ctx - window) // block_size for ctx in context_lens]
    nblocks = [(ctx + block_size - 1) // block_size - f for ctx, f in zip(context_lens, first, strict=True)]
    groups: list[DecodeGroup] = []
    for r in group_decodes(nblocks, block_size, pad_limit):
        max_blocks = max(nblocks[i] for i in r)
        flat: list[int] = []
        for i in r:
            flat.extend(block_tables[i][first[i] : first[i] + nblocks[i]])
            flat.extend([0] * (max_blocks - nblocks[i]))  # padding: any valid block, masked out
        lens = torch.tensor([context_lens[i] for i in r], dtype=torch.long, device=device)
        span = torch.arange(max_blocks * block_size, device=device)
        if window is None:
            mask = span[None, :] < lens[:, None]
        else:  # absolute position of span slot j: first block's start + j
            starts = torch.tensor([first[i] * block_size for i in r], dtype=torch.long, device=device)
            pos = starts[:, None] + span[None, :]
            mask = (pos < lens[:, None]) & (pos >= lens[:, None] - window)
        groups.append(DecodeGroup(r.start, len(r), max_blocks, block_size,
                                  torch.tensor(flat, dtype=torch.long, device=device), mask))
    return groups


def _placed(raw: torch.Tensor, dtype: torch.dtype, workspace: Workspace | None, name: str) -> torch.Tensor:
    """FP8 cache rows' bits placed into ``dtype``: the value divided by ``placed_down(dtype)``
    (the caller folds that and the layer's scale into the scores or the output: no pass over
    the rows scales them)."""
    out = workspace.get(name, tuple(raw.shape), dtype, raw.device) if workspace is not None else None
    return fp8_placed(raw, dtype, out)


def _up(dtype: torch.dtype) -> float:
    """What the other factor of a product with placed FP8 rows is scaled up by: placed values
    are tiny (2**-120 times the value in bf16 and float32) and matrix kernels flush products
    under the smallest normal to zero. The cache holds no subnormal codes (``quantize_fp8``)."""
    return 2.0**64 if placed_down(dtype) > 2.0**64 else 1.0


def _group_attention(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: DecodeGroup,
                     workspace: Workspace | None, scale: float, k_scale: float = 1.0,
                     v_scale: float = 1.0) -> torch.Tensor:
    num_kv_heads, _, _, head_dim = key.shape
    d, num_heads, _ = q.shape
    group = num_heads // num_kv_heads
    # [Hkv, d * max_blocks, block, D] -> [Hkv * d, span, D]: a view, no further copy.
    k = gather_blocks(key, g.block_ids, workspace, "k").view(num_kv_heads * d, g.span, head_dim)
    if k.dtype != q.dtype:  # an FP8 cache: its K scale and the placement fold into the score scale
        k = _placed(k, q.dtype, workspace, "k_dq")
        up = _up(q.dtype)
        q = q * up
        scale = scale * k_scale * placed_down(q.dtype) / up
    # q heads h * group .. h * group + group - 1 share kv head h.
    qg = q.view(d, num_kv_heads, group, head_dim).transpose(0, 1).reshape(num_kv_heads * d, group, head_dim)
    bias = g.bias(num_kv_heads)
    if q.dtype == torch.float32:
        scores = torch.baddbmm(bias, qg, k.transpose(1, 2), alpha=scale)
    else:  # low-precision inputs: scaled, masked and softmaxed in float32 (bias is float32)
        scores = torch.add(bias, torch.bmm(qg, k.transpose(1, 2)), alpha=scale)
    probs = scores.softmax(dim=-1).to(q.dtype)  # [Hkv * d, group, span]; padding gets weight 0
    if q.device.type == "cpu" and value.dtype == q.dtype:
        # P @ V as weighted sums of cache rows (embedding_bag): reads V in place, no gathered copy;
        # one bag per (kv head, sequence, query head), all heads in one call.
        index, offsets = g.bags(group, num_kv_heads, value.shape[1] * value.shape[2])
        out = F.embedding_bag(index, value.view(-1, head_dim), offsets, mode="sum", per_sample_weights=probs.view(-1))
        return out.view(num_kv_heads, d, group, head_dim).transpose(0, 1).reshape(d, num_heads, head_dim)
    v = gather_blocks(value, g.block_ids, workspace, "v").view(num_kv_heads * d, g.span, head_dim)
    if v.dtype != q.dtype:  # an FP8 cache: its V scale and the placement, once on the output
        up = _up(q.dtype)
        out = torch.bmm(probs.mul_(up), _placed(v, q.dtype, workspace, "v_dq"))
        out.mul_(v_scale * placed_down(q.dtype) / up)
    else:
        out = torch.bmm(probs, v)  # [Hkv * d, group, D]
    return out.view(num_kv_heads, d, group, head_dim).transpose(0, 1).reshape(d, num_heads, head_dim)


def decode_attention(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, groups: list[DecodeGroup],
                     workspace: Workspace | None, scale: float, k_scale: float = 1.0,
                     v_scale: float = 1.0) -> torch.Tensor:
    """q [d, Hq, D], one query per sequence, over the layer's cache key/value -> [d, Hq, D].

    An FP8 cache (key/value in ``float8_e4m3fn``) is read as ``fp8 * k_scale`` / ``fp8 * v_scale``.
    """
    if len(groups) == 1:
        return _group_attention(q, key, value, groups[0], workspace, scale, k_scale, v_scale)
    out = torch.empty_like(q)
    for g in groups:
        out[g.start : g.start + g.count] = _group_attention(q[g.start : g.start + g.count], key, value, g,
                                                            workspace, scale, k_scale, v_scale)
    return out
