"""CUDA graphs for decode steps: one graph per batch size of a captured set, a step padded up to
the next size (``--enforce-eager`` turns them off).

A decode-only step of ``n`` sequences runs the graph captured for ``padded_size(n, sizes)``: its
inputs (token ids, positions, int32 block tables of a fixed width, context lengths, slots) are
static buffers the step's values are copied into; padding rows read block 0 with a context of
one token and store nowhere (slot -1, which the KV store skips), and their outputs are dropped.
The kernels' launch parameters depend only on host sizes (the batch, the table width), so a
replay is the same work as the eager step. A graph is captured the first time its size is
needed; a capture that fails (a reference backend forced, an op that syncs) turns graphs off for
the runner, with one warning, and the step runs eagerly.

``capture_sizes`` and ``padded_size`` are plain functions: the bucketing is tested on the CPU,
the graphs themselves in the ``cuda``-marked tests.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from chatfleet.engine.kernels.step_attention import StepTables, kernel_metadata
from chatfleet.engine.models.attention import AttentionMetadata, KVCache

log = logging.getLogger(__name__)

SMALL_SIZES = (1, 2, 4)
SIZE_STEP = 8  # then every multiple of 8
MAX_CAPTURED = 512


def capture_sizes(max_batch: int, limit: int = MAX_CAPTURED) -> tuple[int, ...]:
    """The batch sizes to capture for decode batches of up to ``max_batch`` sequences: 1, 2, 4,
    then multiples of 8, up to the first size that holds ``max_batch`` (at most ``limit``)."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    top = min(max_batch, limit)
    sizes: list[int] = []
    for s in (*SMALL_SIZES, *range(SIZE_STEP, limit + 1, SIZE_STEP)):
        sizes.append(s)
        if s >= top:
            break
    return tuple(sizes)


def padded_size(n: int, sizes: Sequence[int]) -> int | None:
    """The smallest captured size holding ``n`` decodes (None: larger than every graph)."""
    for s in sizes:
        if s >= n:
            return s
    return None


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    output: torch.Tensor  # [size, hidden]: what a replay writes


Forward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata, list[KVCache | None]], torch.Tensor]


class DecodeGraphs:
    """Captured decode steps of one model over its KV caches (uniform KV spec, kernels path)."""

    def __init__(self, forward: Forward, kv_caches: list[KVCache | None], block_size: int, table_width: int,
                 sizes: Sequence[int], device: torch.device, backend: str = "auto") -> None:
        self.forward = forward
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.sizes = tuple(sizes)
        self.device = device
        self.backend = backend
        self.enabled = device.type == "cuda" and bool(self.sizes)
        top = self.sizes[-1] if self.sizes else 0
        self.ids = torch.zeros(top, dtype=torch.long, device=device)
        self.positions = torch.zeros(top, dtype=torch.long, device=device)
        self.tables = torch.zeros((top, table_width), dtype=torch.int32, device=device)
        self.lens = torch.ones(top, dtype=torch.int32, device=device)
        self.slots = torch.full((top,), -1, dtype=torch.long, device=device)
        self._graphs: dict[int, _Graph] = {}
        self._pool = None  # the graphs' shared memory pool (after the first capture)
        self.replays = 0

    @property
    def table_width(self) -> int:
        return int(self.tables.shape[1])

    @property
    def captured(self) -> tuple[int, ...]:
        return tuple(sorted(self._graphs))

    def _meta(self, size: int) -> AttentionMetadata:
        tables = StepTables(self.block_size, self.slots[:size], size, self.tables[:size], self.lens[:size],
                            None, None, None, 0)
        return kernel_metadata(tables, None, self.backend)

    def _capture(self, size: int) -> _Graph:
        meta = self._meta(size)
        ids, pos = self.ids[:size], self.positions[:size]
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up: allocations, autotuning, lazy tables
                self.forward(ids, pos, meta, self.kv_caches)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            output = self.forward(ids, pos, meta, self.kv_caches)
        self._pool = graph.pool()  # type: ignore[assignment]
        return _Graph(graph, output)

    def reset(self) -> None:
        """Drop every captured graph (a capture bakes in host values such as the FP8 KV scales:
        when those change, the graphs are captured again as sizes are needed)."""
        self._graphs.clear()
        self._pool = None

    def capture_all(self) -> tuple[int, ...]:
        """Capture every size now (start-up, largest first so the pool is sized once), over
        padding rows only: a capture's warm-up steps store nothing (every slot -1). Returns the
        sizes captured; a failure turns graphs off as in ``run``."""
        if not self.enabled:
            return ()
        self.ids.zero_()
        self.positions.zero_()
        self.tables.zero_()
        self.lens.fill_(1)
        self.slots.fill_(-1)
        for size in sorted(self.sizes, reverse=True):
            if size in self._graphs:
                continue
            try:
                self._graphs[size] = self._capture(size)
            except Exception as e:  # noqa: BLE001 - as in run: eager from now on
                log.warning("CUDA graph capture of decode batch %d failed (%s: %s); decode steps run eagerly",
                            size, type(e).__name__, e)
                self.enabled = False
                break
        return self.captured

    def run(self, input_ids: Sequence[int], positions: Sequence[int], context_lens: Sequence[int],
            block_tables: Sequence[Sequence[int]]) -> torch.Tensor | None:
        """The hidden states [n, hidden] of a decode-only step replayed from a graph; None when no
        graph takes it (graphs off, too many sequences, a context wider than the tables)."""
        n = len(input_ids)
        size = padded_size(n, self.sizes) if self.enabled else None
        if size is None:
            return None
        bs, width = self.block_size, self.table_width
        rows: list[list[int]] = []
        slots: list[int] = []
        for ctx, table in zip(context_lens, block_tables, strict=True):
            need = -(-ctx // bs)
            if need > width:
                return None
            rows.append([max(b, 0) for b in table[:need]] + [0] * (width - need))
            slots.append(table[(ctx - 1) // bs] * bs + (ctx - 1) % bs)
        pad = size - n
        self.ids[:size].copy_(torch.tensor([*input_ids, *[0] * pad], dtype=torch.long), non_blocking=True)
        self.positions[:size].copy_(torch.tensor([*positions, *[0] * pad], dtype=torch.long), non_blocking=True)
        self.tables[:size].copy_(torch.tensor(rows + [[0] * width] * pad, dtype=torch.int32), non_blocking=True)
        self.lens[:size].copy_(torch.tensor([*context_lens, *[1] * pad], dtype=torch.int32), non_blocking=True)
        self.slots[:size].copy_(torch.tensor([*slots, *[-1] * pad], dtype=torch.long), non_blocking=True)
        graph = self._graphs.get(size)
        if graph is None:
            try:
                graph = self._graphs[size] = self._capture(size)
            except Exception as e:  # noqa: BLE001 - any capture failure: run eagerly from now on
                log.warning("CUDA graph capture of decode batch %d failed (%s: %s); decode steps run eagerly",
                            size, type(e).__name__, e)
                self.enabled = False
                return None
        graph.graph.replay()
        self.replays += 1
        return graph.output[:n]
