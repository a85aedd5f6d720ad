"""How many rows a step's row-wise work (linears, norms, MLP) runs with: the step's token count
rounded up to a bucket, so that oneDNN meets a handful of shapes instead of a new one per step.

Why: a oneDNN matmul primitive is built (its kernel JIT-compiled) for every new number of rows M,
and a serving engine's steps have a new M nearly every time (prompt chunks of every length beside
the decodes). On an AMX Xeon, one thread, the four linears of a ``small`` layer at a new M of ~2,000
cost ~19 ms more than at one seen before (1.0 / 0.8 / 3.8 / 2.1 ms vs 4.9 / 3.3 / 15.7 / 5.3),
~10% of a bf16 prefill step. Up to ``EXACT_UP_TO`` rows (decode batches) the count is kept: those
shapes repeat by themselves; above it rows go up to a multiple of ``BUCKET``: at most
``BUCKET - 1`` padding rows (1.5% of a 2,048-token step), whose results are dropped.
"""

from __future__ import annotations

EXACT_UP_TO = 32
BUCKET = 32


def padded_rows(tokens: int) -> int:
    """The rows a step of ``tokens`` tokens runs its row-wise work with (>= tokens)."""
    if tokens <= EXACT_UP_TO:
        return tokens
    return -(-tokens // BUCKET) * BUCKET
