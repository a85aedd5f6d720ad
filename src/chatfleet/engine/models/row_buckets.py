"""How many rows a step's row-wise work (linears, norms, MLP) runs with: the step's token count
rounded up to a bucket, so that oneDNN meets a handful of shapes instead of a new one per step.

Why: a oneDNN matmul primitive is built (its kernel JIT-compiled) for every new number of rows M,
and a serving engine's steps have a new M nearly every time (prompt chunks of every length beside
the decodes). On an AMX Xeon, one thread, the four linears of a ``small`` layer at a new M of ~2,000
cost ~19 ms more than at one seen before (1.0 / 0.8 / 3.8 / 2.1 ms vs 4.9 / 3.3 / 15.7 / 5.3),
~10% of a bf16 prefill step. Up to ``EXACT_UP_TO`` rows (decode batches, a short chunk beside them)
the count is kept: every linear there runs the packed kernel (``packed_gemv.MAX_ROWS``), which
builds nothing per shape; above it rows go up to a multiple of ``BUCKET``: at most
``BUCKET - 1`` padding rows (1.5% of a 2,048-token step), whose results are dropped.

The buckets only pay if oneDNN keeps every bucket's primitives. A 2,048-token step budget has 96
row counts, each with a ``small`` layer's five products (q/k/v, o, gate with its swish, up with its
multiply, down) plus the lm head's, and each inner_product primitive keeps a matmul primitive of
its own in the same cache: ~1,150 entries, where ``chatfleet/native_caches.py`` bounds the cache to
256 (oneDNN's default: 1,024), so a serving mix evicted them in turn and rebuilt them, 2.5-5 ms
each in bf16 on AMX. With ``all`` at 192 chats (capacity.py's setup, bf16, one thread) py-spy put
9.5% of the engine core's time in oneDNN's JIT; with room for every bucket, 1.7% (the first step
at each row count). ``reserve_primitive_cache`` makes that room where the model's prefill
attention runs in the C++ chunk kernels (``prefill_attention.runs_in_onednn`` false), so that the
only oneDNN shapes are these buckets' (each entry with prepacked weights: no RSS growth measured
over all 96); where attention runs as oneDNN products of ever new shapes (~0.5 MB an entry), the
bound stays. A capacity the user set is kept. oneDNN reads the variable when the process builds its
first primitive, so it runs before the weights are packed.
"""

from __future__ import annotations

from chatfleet.native_caches import ONEDNN_PRIMITIVE_CACHE, widen_native_cache

EXACT_UP_TO = 128  # = packed_gemv.MAX_ROWS: up to here every linear runs the packed kernel, no oneDNN shape
BUCKET = 32
PRIMITIVE_CACHE_CAPACITY = 4096  # 12 entries for each of 341 row counts (a ~10,000-token step budget)


def padded_rows(tokens: int) -> int:
    """The rows a step of ``tokens`` tokens runs its row-wise work with (>= tokens)."""
    if tokens <= EXACT_UP_TO:
        return tokens
    return -(-tokens // BUCKET) * BUCKET


def reserve_primitive_cache() -> bool:
    """Give oneDNN's primitive cache room for every bucket's primitives, unless the user set its
    capacity (whether it has the room; no effect once the process has built a oneDNN primitive)."""
    return widen_native_cache(ONEDNN_PRIMITIVE_CACHE, PRIMITIVE_CACHE_CAPACITY)
