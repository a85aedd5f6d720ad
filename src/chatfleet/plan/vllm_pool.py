"""vLLM's KV pool for the same memory, by its documented v1 rules (vllm/v1/core/kv_cache_utils.py,
as in the 0.32 build this project compares against), from our ``KVCacheSpec``:

- every attention layer has a page of ``block_size`` tokens (``2 x kv_heads x head_dim x dtype``
  bytes per token); pages of different sizes are padded to the largest (``unify_kv_cache_spec_page_size``;
  vLLM may instead grow a smaller page's block size when it divides evenly: not modelled);
- one attention type: one KV cache group of all layers; several (sliding/full hybrids): layers
  of each type are split into groups of ``group_size`` layers, the fewest layers of any type (or
  the most, when that is under 1.5x the fewest), the last group of a type padded
  (``_get_kv_cache_groups_uniform_page_size``);
- every group draws from one shared pool: ``num_blocks = memory // (group_size x page)``
  (``get_kv_cache_config_from_groups``; a uniform model's group is all layers);
- capacity: a request of ``max_model_len`` needs its blocks in every group (full attention: all
  of them; sliding: ``ceil(window / block) + 1``); max concurrency = num_blocks / that sum, and
  vLLM logs ``max_concurrency x max_model_len`` as "KV cache size: N tokens".

Ours (``KVCacheSpec.plan_pools``) gives each layer group its own pool, split by need; for a
uniform model both give the same block count.
"""

from __future__ import annotations

from dataclasses import dataclass

from chatfleet.engine.kv.spec import KVCacheSpec


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class VllmPool:
    num_blocks: int
    block_size: int
    group_size: int  # layers per KV cache group
    num_groups: int
    padding_layers: int
    page_bytes: int  # one layer's page after padding
    blocks_per_max_request: int
    max_model_len: int

    @property
    def max_concurrency(self) -> float:
        return self.num_blocks / self.blocks_per_max_request

    @property
    def kv_cache_tokens(self) -> int:
        """What vLLM logs as 'GPU KV cache size: N tokens'."""
        return int(self.max_concurrency * self.max_model_len)


def vllm_pool(spec: KVCacheSpec, memory_bytes: int, max_model_len: int) -> VllmPool:
    block = spec.block_size
    page = max(g.bytes_per_token_per_layer for g in spec.groups) * block
    counts = [g.num_layers for g in spec.groups]
    group_size = min(counts)
    if max(counts) < 1.5 * min(counts):
        group_size = max(counts)
    num_groups = padding = per_request = 0
    for g in spec.groups:
        n = _cdiv(g.num_layers, group_size)
        num_groups += n
        padding += n * group_size - g.num_layers
        per_request += n * g.blocks_for(max_model_len)
    return VllmPool(memory_bytes // (group_size * page), block, group_size, num_groups, padding, page,
                    per_request, max_model_len)
