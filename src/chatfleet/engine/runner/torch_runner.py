"""Runs scheduler plans on a PyTorch model with a paged KV cache, then samples."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial

import torch

from chatfleet.engine.kernels.backend import BACKENDS as KERNEL_DISPATCH
from chatfleet.engine.kernels.fp8_gemm import fp8_block_linear
from chatfleet.engine.kernels.moe_experts import use_grouped_experts
from chatfleet.engine.kernels.step_attention import build_step_tables, kernel_metadata
from chatfleet.engine.models.attention import AttentionMetadata, KVCache, Workspace, build_attention_metadata
from chatfleet.engine.models.backends import DECODE_KERNELS
from chatfleet.engine.models.checkpoint import LoadedModel, resolve_dtype
from chatfleet.engine.models.fp8_model import use_block_gemm
from chatfleet.engine.models.kv_cache import FP8
from chatfleet.engine.models.kv_calibration import measure_kv_scales
from chatfleet.engine.models.kv_scales import MISSING_SCALES_WARNING, KVScales
from chatfleet.engine.models.paged_decode_cpu import MAX_GROUP, MAX_HEAD_DIM
from chatfleet.engine.models.paged_decode_cpu import available as decode_kernel_available
from chatfleet.engine.models.paged_decode_cpu import fits as decode_kernel_fits
from chatfleet.engine.models.qwen3 import Qwen3Config
from chatfleet.engine.outputs import (
    NO_TRANSFERS,
    RunnerOutput,
    SampledToken,
    ScheduledChunk,
    SchedulerOutput,
    TokenLogprob,
)
from chatfleet.engine.runner.copy_engine import CopyEngine
from chatfleet.engine.runner.decode_graphs import DecodeGraphs, capture_sizes
from chatfleet.engine.runner.kv_transfer import HostKVTransfer
from chatfleet.engine.runner.sampler import Sampler, SamplingRow, top_logprobs


def kv_bytes_per_token(model_config: Qwen3Config, dtype: str | torch.dtype) -> int:
    """KV cache bytes one token takes across all layers (keys and values), from the KV spec."""
    name = str(resolve_dtype(dtype)).removeprefix("torch.")
    return model_config.kv_cache_spec(kv_dtype=name).bytes_per_token


log = logging.getLogger(__name__)

# Which attention path a step takes: ``gather`` (decode groups gathered with index_select,
# models/attention.py: the CPU's fast path), ``kernels`` (block tables built once per step and
# the dispatched kernels, kernels/step_attention.py: the GPU's path, and on the CPU the same
# wiring over the torch references), ``auto`` (kernels on CUDA, gather elsewhere).
ATTENTION_PATHS = ("auto", "gather", "kernels")


def resolve_attention_path(requested: str, device: torch.device) -> str:
    if requested not in ATTENTION_PATHS:
        raise ValueError(f"unknown attention path {requested!r}; valid: {', '.join(ATTENTION_PATHS)}")
    if requested == "auto":
        return "kernels" if device.type == "cuda" else "gather"
    return requested


# The decode attention of the CPU's gather path: ``cpp`` (the C++ kernel reading K/V in place,
# models/paged_decode_cpu.py; an error where it cannot build or does not take the model),
# ``torch`` (torch ops over padded groups, decode_attention.py), ``auto`` (cpp where it builds
# and takes the model's shapes, dtype and cache, else torch); names in models/backends.py.


def resolve_decode_kernel(requested: str, device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype,
                          head_dims: set[int], groups: set[int]) -> str:
    """``cpp`` or ``torch`` for the gather path's decodes (sliding-window layers always use torch)."""
    if requested not in DECODE_KERNELS:
        raise ValueError(f"unknown decode kernel {requested!r}; valid: {', '.join(DECODE_KERNELS)}")
    if requested == "torch":
        return "torch"
    fits = all(decode_kernel_fits(device, dtype, kv_dtype, head_dim, group)
               for head_dim in head_dims or {0} for group in groups or {1})
    if fits and decode_kernel_available():
        return "cpp"
    if requested == "cpp":
        why = "no C++ compiler or a failed build" if fits else (
            f"it needs a CPU, a float32/bfloat16 model with a cache of its dtype or FP8, head dims up to "
            f"{MAX_HEAD_DIM} and at most {MAX_GROUP} query heads per kv head; got {device.type}, {dtype}, "
            f"cache {kv_dtype}, "
            f"head dims {sorted(head_dims)}, groups {sorted(groups)}")
        raise ValueError(f"the cpp decode kernel cannot run here: {why}")
    return "torch"


def initial_kv_scales(loaded: LoadedModel, from_prompts: int | None) -> tuple[KVScales | None, int]:
    """An FP8 cache's scales at start-up, and how many prompt tokens are still to measure them.

    The checkpoint's scales win; else measure from ``from_prompts`` tokens; else 1.0 and one warning.
    """
    if loaded.kv_scales is not None:
        log.info("%s", loaded.kv_scales.describe())
        return loaded.kv_scales, 0
    if from_prompts:
        log.info("FP8 KV cache: scales will be measured from the first %d prompt tokens", from_prompts)
        return None, from_prompts
    log.warning(MISSING_SCALES_WARNING)
    return KVScales.ones(loaded.config.num_layers), 0

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8
_malloc_tuned = False


def keep_freed_memory() -> bool:
    """Make glibc malloc keep freed activation buffers for reuse (process-wide, once).

    A CPU step allocates and frees tens of MB of activations. By default glibc returns them to
    the OS (``mmap``/trim, and per-thread arenas shrink), so the next step page-faults them in
    again: 5-8% of the engine thread's CPU time. One arena, a 32 MiB mmap threshold and no
    trimming keep them. Returns False where this is not glibc.
    """
    global _malloc_tuned
    if _malloc_tuned:
        return True
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        ok = all(libc.mallopt(param, value) == 1 for param, value in (
            (_M_ARENA_MAX, 1), (_M_MMAP_THRESHOLD, 32 << 20), (_M_TRIM_THRESHOLD, 1 << 30)))
    except (OSError, AttributeError):
        return False
    _malloc_tuned = ok
    if not ok:
        log.debug("mallopt refused; CPU steps will page-fault their activations")
    return ok


@dataclass
class _PendingPromptRow:
    """Log-probabilities from a chunk's last position, scoring the next chunk's first token."""

    position: int
    logprobs: torch.Tensor  # [V]


class TorchRunner:
    """``execute(SchedulerOutput) -> RunnerOutput`` on a loaded model; owns the KV cache tensors."""

    def __init__(self, loaded_model: LoadedModel, num_blocks: int | Mapping[str, int], block_size: int,
                 device: str | torch.device | None = None, seed: int = 0, num_host_blocks: int = 0,
                 kv_cache_dtype: str = "auto", kv_scales_from_prompts: int | None = None,
                 attention: str = "auto", kernel_backend: str = "auto", enforce_eager: bool = False,
                 max_decode_batch: int = 256, copy_engine: CopyEngine | None = None,
                 decode_kernel: str = "auto") -> None:
        # One pool size for every layer group, or one per group name (kv/hybrid.py).
        group_blocks = dict(num_blocks) if isinstance(num_blocks, Mapping) else None
        blocks = max(num_blocks.values(), default=0) if isinstance(num_blocks, Mapping) else num_blocks
        if blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {blocks}, {block_size}")
        self.loaded = loaded_model
        self.model = loaded_model.model
        self.config = loaded_model.config
        self.device = torch.device(device) if device is not None else loaded_model.device
        self._num_blocks = blocks
        self._block_size = block_size
        kv_dtype = FP8 if kv_cache_dtype == "fp8" else (
            loaded_model.dtype if kv_cache_dtype == "auto" else resolve_dtype(kv_cache_dtype))
        self.kv_scales: KVScales | None = None  # FP8 cache only; None while waiting to measure them
        self._calibrate_tokens = 0
        if kv_dtype == FP8:
            self.kv_scales, self._calibrate_tokens = initial_kv_scales(loaded_model, kv_scales_from_prompts)
        scales = self.kv_scales or KVScales.ones(self.config.num_layers)
        # One cache per layer that stores KV, shaped by its layer group (KV-sharing layers: None).
        self.kv_spec = self.config.kv_cache_spec(block_size, str(loaded_model.dtype).removeprefix("torch."))
        self.kv_caches: list[KVCache | None] = [None] * max(self.kv_spec.num_model_layers, 1)
        if group_blocks is not None:  # the longest request: what a full-attention pool holds
            self._num_blocks = min((group_blocks[g.name] for g in self.kv_spec.groups if not g.is_sliding),
                                   default=blocks)
        layers = [(i, (group_blocks[g.name] if group_blocks is not None else blocks, block_size, g.num_kv_heads,
                       g.head_dim)) for g in self.kv_spec.groups for i in g.layer_indices]
        allocated = KVCache.allocate_many([shape for _, shape in layers], kv_dtype, self.device,
                                          [(scales.k[i], scales.v[i]) for i, _ in layers])
        for (i, _), cache in zip(layers, allocated, strict=True):
            self.kv_caches[i] = cache
        device_caches = [c for c in self.kv_caches if c is not None]
        self.host_kv = (HostKVTransfer(device_caches, num_host_blocks, copy_engine) if num_host_blocks > 0
                        else None)
        self.attention = resolve_attention_path(attention, self.device)
        layer_groups = [g for g in self.kv_spec.groups if not g.is_sliding]  # windows: torch ops
        self.decode_kernel = resolve_decode_kernel(
            decode_kernel, self.device, loaded_model.dtype, kv_dtype, {g.head_dim for g in layer_groups},
            {self.config.num_heads // g.num_kv_heads for g in layer_groups})
        if kernel_backend not in KERNEL_DISPATCH:
            raise ValueError(f"unknown kernel backend {kernel_backend!r}; valid: {', '.join(KERNEL_DISPATCH)}")
        self.kernel_backend = kernel_backend
        # The kernels path takes the FP8 linears through the block GEMM too (set either way: a
        # model shared by runners follows the latest one's path).
        use_block_gemm(self.model, partial(fp8_block_linear, backend=kernel_backend)
                       if self.attention == "kernels" else None)
        use_grouped_experts(self.model, kernel_backend if self.attention == "kernels" else None)
        self.graphs: DecodeGraphs | None = None
        if (self.device.type == "cuda" and not enforce_eager and self.attention == "kernels"
                and self.kv_spec.is_uniform):
            width = min(-(-loaded_model.max_model_len // block_size), self._num_blocks)
            self.graphs = DecodeGraphs(self.model, self.kv_caches, block_size, width,
                                       capture_sizes(max_decode_batch), self.device, kernel_backend)
        if self.device.type == "cpu":
            keep_freed_memory()
        self.sampler = Sampler(loaded_model.tokenizer.stop_token_ids, seed=seed, device=self.device)
        self._generators: dict[str, torch.Generator] = {}
        self._workspace = Workspace()
        self._pending_prompt: dict[str, _PendingPromptRow] = {}

    def capture_graphs(self) -> tuple[int, ...]:
        """Capture the decode graphs of every batch size now (the builder does, at start-up)."""
        if self.graphs is None or self._calibrate_tokens:  # scales still to measure: capture after
            return ()
        with torch.inference_mode():
            return self.graphs.capture_all()

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def num_host_blocks(self) -> int:
        return self.host_kv.num_host_blocks if self.host_kv is not None else 0

    @property
    def vocab_size(self) -> int:
        """The model's vocabulary (valid token ids are 0 .. vocab_size - 1)."""
        return self.config.vocab_size

    @property
    def max_model_len(self) -> int:
        return self.loaded.max_model_len

    @property
    def num_request_states(self) -> int:
        """Requests with live per-request state (for leak checks)."""
        return len(set(self._generators) | set(self._pending_prompt))

    def _generator(self, chunk: ScheduledChunk) -> torch.Generator | None:
        seed = chunk.sampling_params.seed
        if seed is None or chunk.sampling_params.greedy:
            return None
        gen = self._generators.get(chunk.request_id)
        if gen is None:
            gen = torch.Generator(device=self.device).manual_seed(seed)
            self._generators[chunk.request_id] = gen
        return gen

    def _check_chunk(self, c: ScheduledChunk) -> None:
        if len(c.block_table) * self._block_size < c.context_length:
            raise ValueError(
                f"request {c.request_id}: block table of {len(c.block_table)} blocks cannot hold "
                f"{c.context_length} tokens (block size {self._block_size})"
            )

    def execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        for rid in scheduler_output.finished_request_ids:
            self._generators.pop(rid, None)
            self._pending_prompt.pop(rid, None)
        transfer_stats = NO_TRANSFERS
        if scheduler_output.kv_transfers:
            if self.host_kv is None:
                raise ValueError("a plan with KV transfers for a runner without a host tier")
            with torch.inference_mode():
                transfer_stats = self.host_kv.execute(scheduler_output.kv_transfers)
        if not scheduler_output.chunks:
            return RunnerOutput(sampled={}, kv_transfer=transfer_stats)
        chunks = scheduler_output.chunks
        for c in chunks:
            self._check_chunk(c)
        if self._calibrate_tokens:
            self._measure_kv_scales(chunks)
        # Decodes first, shortest context first (decode attention groups similar lengths).
        decodes = sorted((c for c in chunks if c.num_tokens == 1), key=lambda c: c.context_length)
        prefills = [c for c in chunks if c.num_tokens > 1]
        order = decodes + prefills

        input_ids: list[int] = []
        positions: list[int] = []
        for c in decodes:
            input_ids.append(c.token_ids[0])
            positions.append(c.start_position)
        for c in prefills:
            input_ids.extend(c.token_ids)
            positions.extend(range(c.start_position, c.context_length))
        if self.host_kv is not None and self.host_kv.stores_in_flight:  # no step writes a block
            self.host_kv.before_write(self._written_blocks(order))  # whose store is still in flight

        # Rows of the hidden states that need logits: last token of sampling chunks, and every
        # token of chunks that want prompt logprobs.
        sample_chunks: list[ScheduledChunk] = []
        rows: list[int] = []
        prompt_chunks: list[tuple[ScheduledChunk, int]] = []  # (chunk, first logits row)
        offset = 0
        sample_rows: list[int] = []
        for c in order:
            if c.want_prompt_logprobs:
                prompt_chunks.append((c, len(rows)))
                rows.extend(range(offset, offset + c.num_tokens))
            if c.sample:
                sample_chunks.append(c)
                sample_rows.append(len(rows) - 1 if c.want_prompt_logprobs else len(rows))
                if not c.want_prompt_logprobs:
                    rows.append(offset + c.num_tokens - 1)
            offset += c.num_tokens

        with torch.inference_mode():
            hidden = None
            if self.graphs is not None and not prefills:
                hidden = self.graphs.run(input_ids, positions, [c.context_length for c in decodes],
                                         [c.block_table for c in decodes])
            if hidden is None:
                meta = self._attention_metadata(decodes, prefills)
                ids_t = torch.tensor(input_ids, dtype=torch.long, device=self.device)
                pos_t = torch.tensor(positions, dtype=torch.long, device=self.device)
                hidden = self.model(ids_t, pos_t, meta, self.kv_caches)
            if not rows:
                return RunnerOutput(sampled={}, kv_transfer=transfer_stats)
            # rows and sample_rows rise strictly: as many as there are rows means every row, in order.
            logits = self.model.compute_logits(
                hidden if len(rows) == hidden.shape[0] else hidden[torch.tensor(rows, device=self.device)])
            prompt_lps = {c.request_id: self._prompt_logprobs(c, logits[r : r + c.num_tokens])
                          for c, r in prompt_chunks}
            sampled: dict[str, SampledToken] = {}
            if sample_chunks:
                sample_logits = (logits if len(sample_rows) == len(rows)
                                 else logits[torch.tensor(sample_rows, device=self.device)])
                sampling_rows = [
                    SamplingRow(c.sampling_params, c.num_output_tokens, c.eos_token_id, self._generator(c),
                                c.prompt_token_ids, c.output_token_ids)
                    for c in sample_chunks
                ]
                mask = scheduler_output.token_bitmask  # structured output: allowed tokens per row
                tokens = self.sampler.sample(sample_logits, sampling_rows, mask.rows_of(
                    [c.request_id for c in sample_chunks]) if mask is not None else None)
                sampled = {c.request_id: t for c, t in zip(sample_chunks, tokens, strict=True)}
        return RunnerOutput(sampled=sampled, prompt_logprobs=prompt_lps, kv_transfer=transfer_stats)

    def _attention_metadata(self, decodes: list[ScheduledChunk], prefills: list[ScheduledChunk]
                            ) -> AttentionMetadata | dict[str, AttentionMetadata]:
        """One metadata for a single full-attention group; else one per layer group (its window)."""

        def table(c: ScheduledChunk, group: str | None) -> list[int]:
            if group is None or c.group_block_tables is None:
                return c.block_table
            return c.group_block_tables[group]

        decode_lens = [c.context_length for c in decodes]
        starts = [c.start_position for c in prefills]
        lens = [c.num_tokens for c in prefills]

        def build(window: int | None, group: str | None = None) -> AttentionMetadata:
            decode_tables = [table(c, group) for c in decodes]
            chunk_tables = [table(c, group) for c in prefills]
            if self.attention == "kernels":
                tables = build_step_tables(
                    self._block_size, decode_context_lens=decode_lens, decode_block_tables=decode_tables,
                    chunk_starts=starts, chunk_lens=lens, chunk_block_tables=chunk_tables, device=self.device,
                )
                return kernel_metadata(tables, window, self.kernel_backend)
            meta = build_attention_metadata(
                self._block_size, decode_context_lens=decode_lens, decode_block_tables=decode_tables,
                chunk_starts=starts, chunk_lens=lens, chunk_block_tables=chunk_tables, device=self.device,
                sliding_window=window, decode_kernel=self.decode_kernel == "cpp" and window is None,
            )
            meta.workspace = self._workspace
            return meta

        if self.kv_spec.is_uniform:
            return build(None)
        return {g.name: build(g.sliding_window, g.name) for g in self.kv_spec.groups}

    def _written_blocks(self, chunks: list[ScheduledChunk]) -> list[int]:
        """The device blocks this step's new tokens go to."""
        bs = self._block_size
        return [b for c in chunks for b in c.block_table[c.start_position // bs : (c.context_length - 1) // bs + 1]]

    def _measure_kv_scales(self, chunks: list[ScheduledChunk]) -> None:
        """Set and freeze the FP8 cache scales from this first step's fresh prompts (before any write)."""
        prompts = [c.token_ids for c in chunks if c.start_position == 0]
        used = min(sum(map(len, prompts)), self._calibrate_tokens)
        scales = measure_kv_scales(self.model, prompts, self._calibrate_tokens, self.device)
        for cache, ks, vs in zip(self.kv_caches, scales.k, scales.v, strict=True):
            assert cache is not None  # measured scales: a model whose every layer has its own cache
            cache.k_scale, cache.v_scale = ks, vs
        self.kv_scales, self._calibrate_tokens = scales, 0
        if self.graphs is not None:  # captured launches carry the old scales
            self.graphs.reset()
        log.info("%s (measured on %d prompt tokens, now fixed)", scales.describe(), used)

    def _prompt_logprobs(self, c: ScheduledChunk, logits: torch.Tensor) -> list[TokenLogprob]:
        """Scores of the chunk's tokens (the first one by the previous chunk's last position)."""
        k = c.sampling_params.prompt_logprobs or 0
        lps = logits.log_softmax(dim=-1)
        pending = self._pending_prompt.pop(c.request_id, None)
        score_rows: list[torch.Tensor] = []
        targets: list[int] = []
        if pending is not None and pending.position == c.start_position:
            score_rows.append(pending.logprobs.unsqueeze(0))
            targets.append(c.token_ids[0])
        if c.num_tokens > 1:
            score_rows.append(lps[: c.num_tokens - 1])
            targets.extend(c.token_ids[1:])
        if not c.sample:
            self._pending_prompt[c.request_id] = _PendingPromptRow(c.context_length, lps[-1].clone())
        if not targets:
            return []
        return top_logprobs(torch.cat(score_rows), targets, [k] * len(targets))
