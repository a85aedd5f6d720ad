"""A step's decoder layers in one C++ call (``decode_stack_cpu.cpp``), for a Qwen3 dense model whose
every piece of a decode step already runs in this package's C++ kernels: decode rows, and beside
them prompt chunks (returning turns' new tokens, short prompts), up to ``packed_gemv.MAX_ROWS`` rows.

Why: a decode step of ``small`` (8 layers) makes ~90 kernel calls from Python (per layer: the norms,
four or five packed linears, q/k norm + RoPE, the KV store, the paged decode), each through a module
call, a wrapper's checks and a ctypes call with a dozen converted arguments, with fresh output
tensors and views between them. Timed around the kernels (AMD EPYC Zen 4, one thread, context ~530),
that Python was ~0.7 ms of a 6.1 ms bf16 step at batch 8 and ~1 ms of 10 ms in float32. With the
layers in one call over one reused workspace the steps are shorter by more than that (why was not
measured apart; the modules allocate fresh outputs every call, the stack does not): paired,
alternating step by step, bf16 0.68x / 0.75x / 0.87x the modules' step at batch 1 / 8 / 32, float32
0.83x / 0.83x / 0.91x (benchmarks/README.md, session 20). The C++ side calls the same kernels (by
the addresses their libraries export, ``cpu_kernel_build.KernelLoader.address``) in the modules'
order on the same operands, so the hidden states are the modules' bits; the tests compare them at
every step, and the greedy equivalence tests run through it.

It takes a step (``DecodeStack.takes``) where the modules would make exactly those kernel calls: at
most ``packed_gemv.MAX_ROWS`` rows, decode rows with the C++ decode kernel's block tables in the
metadata, then prompt chunks whose attention runs in a C++ chunk kernel (``_chunk_kernel``:
AMX in bf16 where the CPU has it, else AVX-512's pair dot products; AVX-512 in float32) and whose
cache is the model's dtype; every layer's cache present (the model's dtype or FP8 for decode rows
alone), no KV observer (scale calibration), no sliding window; and (``build_decode_stack``) a float32
or bfloat16 model with every linear packed where the packed kernel reads it, the MLP's halves too in
bf16, and every kernel built. A chunk's keys and values are gathered from the cache block by block
into a buffer of the stack's (the modules gather the same blocks, ``attention.paged_attention``).
Anything else runs the modules. Nothing to switch: ``Qwen3ForCausalLM`` builds it with the oneDNN
backend; ``decode_stack_enabled = False`` (tests, A/B runs) keeps the modules.

Chunks beside the decodes are the steps capacity.py's ``all`` runs at its knee: a returning turn's
~40 new tokens joining ~15 running replies. Through the modules such a step cost ~2.3x a decode-only
step of its decodes (AMX Xeon, bf16, one thread: 18.6 against 8.1 ms, ``profile_step.py``'s
returning workload), most of it the Python between ~130 kernel calls.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import torch

from chatfleet.engine.models import (
    chunk_attention_amx,
    chunk_attention_avx512,
    packed_gemv,
    paged_decode_cpu,
    qk_norm_rope,
    row_ops,
)
from chatfleet.engine.models.attention import AttentionMetadata
from chatfleet.engine.models.cpu_kernel_build import KernelLoader
from chatfleet.engine.models.kv_cache import FP8, KVCache
from chatfleet.engine.models.linear import Linear
from chatfleet.engine.models.swiglu import GateUpLinear


class _Weighted(Protocol):
    @property
    def weight(self) -> torch.Tensor: ...


class StackAttention(Protocol):
    """What the stack reads of a Qwen3 attention module (``qwen3.Qwen3Attention``)."""

    qk_norm_weight: torch.Tensor | None

    @property
    def qkv_proj(self) -> Linear: ...
    @property
    def o_proj(self) -> Linear: ...
    @property
    def kv_observer(self) -> object: ...
    def fuse_qk_norms(self) -> None: ...


class StackMLP(Protocol):
    @property
    def gate_up_proj(self) -> GateUpLinear: ...
    @property
    def down_proj(self) -> Linear: ...


class StackLayer(Protocol):
    """What the stack reads of a Qwen3 decoder layer (``qwen3.Qwen3DecoderLayer``; a protocol, so
    that this module, which qwen3 imports, does not import qwen3)."""

    @property
    def input_layernorm(self) -> _Weighted: ...
    @property
    def post_attention_layernorm(self) -> _Weighted: ...
    @property
    def self_attn(self) -> StackAttention: ...
    @property
    def mlp(self) -> StackMLP: ...


class StackConfig(Protocol):
    """The model shape the stack needs (``qwen3.Qwen3Config``)."""

    @property
    def hidden_size(self) -> int: ...
    @property
    def intermediate_size(self) -> int: ...
    @property
    def num_heads(self) -> int: ...
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def rms_norm_eps(self) -> float: ...

SOURCE = Path(__file__).with_name("decode_stack_cpu.cpp")
FLAGS = ("-O2", "-fPIC", "-std=c++17")
LINK_FLAGS = ("-shared",)

_ptr, _i64, _f32, _int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int


class _Kernels(ctypes.Structure):
    _fields_ = [(name, _ptr) for name in ("packed_linear", "rms_norm", "add_rms_norm", "silu_and_mul",
                                          "qk_norm_rope", "paged_decode", "store_kv", "store_kv_fp8")]


class _Weight(ctypes.Structure):
    _fields_ = [("data", _ptr), ("n", _i64), ("k", _i64), ("k_padded", _i64), ("block_n", _i64), ("bias", _ptr)]


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", _ptr), ("post_norm", _ptr), ("qk_norm", _ptr),
                ("qkv", _Weight), ("o", _Weight), ("gate", _Weight), ("up", _Weight), ("down", _Weight),
                ("key_cache", _ptr), ("value_cache", _ptr), ("k_scale", _f32), ("v_scale", _f32)]


class _Model(ctypes.Structure):
    _fields_ = [("hidden", _i64), ("heads", _i64), ("kv_heads", _i64), ("head_dim", _i64), ("intermediate", _i64),
                ("layers", _i64), ("num_blocks", _i64), ("block_size", _i64), ("eps", _f32), ("scale", _f32),
                ("bf16", _int), ("fp8", _int), ("halves", _int), ("silu_chunk", _i64), ("final_norm", _ptr),
                ("layer", ctypes.POINTER(_Layer)), ("kernels", _Kernels)]


class _Step(ctypes.Structure):
    _fields_ = [("batch", _i64), ("embeddings", _ptr), ("cos", _ptr), ("sin", _ptr), ("slots", _ptr),
                ("block_tables", _ptr), ("table_width", _i64), ("context_lens", _ptr), ("out", _ptr),
                ("workspace", _ptr), ("threads", _int), ("decodes", _i64), ("chunks", _i64), ("chunk_info", _ptr),
                ("chunk_blocks", _ptr), ("chunk_kv", _ptr), ("chunk_attention", _ptr)]


def _bind(lib: ctypes.CDLL) -> str | None:
    lib.cf_decode_stack.restype = ctypes.c_int
    lib.cf_decode_stack.argtypes = (ctypes.POINTER(_Model), ctypes.POINTER(_Step))
    lib.cf_decode_stack_workspace.restype = ctypes.c_int64
    lib.cf_decode_stack_workspace.argtypes = (ctypes.POINTER(_Model), ctypes.c_int64)
    return None


_LOADER = KernelLoader(SOURCE, FLAGS, LINK_FLAGS, "decode layer stack (one C++ call a step)",
                       "decode steps call the kernels layer by layer from Python", _bind)

_KERNEL_SYMBOLS = (
    (packed_gemv.address, "cf_packed_linear"), (row_ops.address, "cf_rms_norm"),
    (row_ops.address, "cf_add_rms_norm"), (row_ops.address, "cf_silu_and_mul"),
    (qk_norm_rope.address, "cf_qk_norm_rope"), (paged_decode_cpu.address, "cf_paged_decode"),
    (paged_decode_cpu.address, "cf_store_kv"), (paged_decode_cpu.address, "cf_store_kv_fp8"),
)


def _chunk_kernel(dtype: torch.dtype, head_dim: int) -> int | None:
    """The entry point of the chunk kernel ``prefill_attention.chunk_attention`` runs for a chunk of
    this dtype and head dim (oneDNN backend, no window, keys from position 0) over a compact cache
    copy, or None where that is not a C++ chunk kernel taking it as the stack hands it over."""
    if dtype == torch.bfloat16 and head_dim in chunk_attention_amx.HEAD_DIMS and chunk_attention_amx.available():
        return chunk_attention_amx.address("cf_chunk_attention_amx")
    if head_dim not in chunk_attention_avx512.HEAD_DIMS or not chunk_attention_avx512.available():
        return None
    if dtype == torch.float32:
        return chunk_attention_avx512.address("cf_chunk_attention_avx512")
    if dtype == torch.bfloat16 and chunk_attention_avx512.has_pair_dots():
        return chunk_attention_avx512.address("cf_chunk_attention_avx512_bf16")
    return None  # bf16 widened to float32 around the kernel: the modules do that


def _kernels() -> _Kernels | None:
    """The kernels' entry points, or None where one of them is not loaded here."""
    addresses = [address(symbol) for address, symbol in _KERNEL_SYMBOLS]
    if any(a is None for a in addresses) or _LOADER.load() is None:
        return None
    return _Kernels(*addresses)


def _weight(linear: Linear, packed: torch.Tensor | None, layout: packed_gemv.PackedLayout | None,
            dtype: torch.dtype) -> _Weight | None:
    """A packed weight as the C++ side reads it; None where the packed kernel does not read it."""
    if packed is None or layout is None or layout.dtype != dtype:
        return None
    bias = linear.bias
    if bias is not None and (bias.dtype != dtype or not bias.is_contiguous()):
        return None
    return _Weight(int(torch.ops.mkldnn.data_ptr(packed)), layout.n, layout.k, layout.k_padded, layout.block_n,
                   bias.data_ptr() if bias is not None else None)


def _plain(t: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype) -> bool:
    return t is not None and t.dtype == dtype and tuple(t.shape) == shape and t.is_contiguous() and t.is_cpu


class DecodeStack:
    """One model's decoder layers as the C++ stack reads them (weights bound once; caches bound at
    the first step that uses them, again whenever they change)."""

    def __init__(self, config: StackConfig, dtype: torch.dtype, layers: list[_Layer], final_norm: torch.Tensor,
                 halves: bool, keep: list[torch.Tensor], kernels: _Kernels,
                 decoder_layers: Sequence[StackLayer]) -> None:
        self.config = config
        self.dtype = dtype
        self._layers = (_Layer * len(layers))(*layers)
        self._decoder_layers = decoder_layers
        self._keep = keep  # every tensor whose memory the structures point into
        self._model = _Model(
            hidden=config.hidden_size, heads=config.num_heads, kv_heads=config.num_kv_heads,
            head_dim=config.head_dim, intermediate=config.intermediate_size, layers=len(layers),
            eps=config.rms_norm_eps, scale=config.head_dim**-0.5, bf16=int(dtype == torch.bfloat16),
            halves=int(halves), silu_chunk=row_ops.silu_step(dtype),
            final_norm=final_norm.data_ptr(), layer=ctypes.cast(self._layers, ctypes.POINTER(_Layer)),
            kernels=kernels)
        self._bound: tuple[tuple[int, int, float, float], ...] | None = None
        lib = _LOADER.load()
        assert lib is not None  # build_decode_stack checked
        # One workspace for the most rows a step can have (``takes``), sized once, not per step.
        need = int(lib.cf_decode_stack_workspace(ctypes.byref(self._model), packed_gemv.MAX_ROWS))
        self._workspace = torch.empty(need, dtype=torch.uint8)
        self._chunk_kernel = _chunk_kernel(dtype, config.head_dim)
        self._chunk_kv = torch.empty(0, dtype=dtype)  # a chunk's gathered keys and values, grown as needed

    def takes(self, tokens: int, meta: object, caches: Sequence[KVCache | None] | None) -> bool:
        """Whether a step of ``tokens`` rows with this metadata and these caches runs in the stack."""
        if (not isinstance(meta, AttentionMetadata) or meta.ops is not None
                or meta.sliding_window is not None or not 1 <= tokens <= packed_gemv.MAX_ROWS
                or caches is None or len(caches) < len(self._decoder_layers)):
            return False
        d = meta.num_decodes
        if d and (meta.decode_block_tables is None or meta.decode_context_lens is None):
            return False
        row = d
        for c in meta.chunks:
            if self._chunk_kernel is None or c.query_start != row or c.key_start or c.query_len < 1:
                return False
            row += c.query_len
        if row != tokens:
            return False
        if any(layer.self_attn.kv_observer is not None for layer in self._decoder_layers):
            return False
        return self._bind_caches(caches) and not (meta.chunks and self._model.fp8)

    def _bind_caches(self, caches: Sequence[KVCache | None]) -> bool:
        cfg = self.config
        key: list[tuple[int, int, float, float]] = []
        first = caches[0]
        if first is None:
            return False
        shape = first.key.shape
        for cache in caches[: len(self._decoder_layers)]:
            if (cache is None or cache.key.dtype not in (self.dtype, FP8) or cache.key.dtype != first.key.dtype
                    or cache.key.shape != shape or cache.value.shape != shape or cache.value.dtype != cache.key.dtype
                    or not cache.key.is_contiguous() or not cache.value.is_contiguous() or not cache.key.is_cpu):
                return False
            key.append((cache.key.data_ptr(), cache.value.data_ptr(), float(cache.k_scale), float(cache.v_scale)))
        if shape[0] != cfg.num_kv_heads or shape[3] != cfg.head_dim:
            return False
        bound = tuple(key)
        if bound != self._bound:
            for layer, (k, v, ks, vs) in zip(self._layers, bound, strict=True):
                layer.key_cache, layer.value_cache, layer.k_scale, layer.v_scale = k, v, ks, vs
            self._model.num_blocks, self._model.block_size = shape[1], shape[2]
            self._model.fp8 = int(first.key.dtype == FP8)
            self._bound = bound
        return True

    def run(self, embeddings: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata
            ) -> torch.Tensor:
        """The final norm's output [B, hidden] for a step ``takes`` accepted (the caches it bound):
        embeddings [B, hidden], cos/sin [B, 1, head_dim] (``qwen3.Rotary.lookup``)."""
        batch, d, decodes = embeddings.shape[0], self.config.head_dim, meta.num_decodes
        tables, lens = meta.decode_block_tables, meta.decode_context_lens
        ok = (1 <= batch <= packed_gemv.MAX_ROWS and _plain(embeddings, (batch, self.config.hidden_size), self.dtype)
              and _plain(cos, (batch, 1, d), self.dtype) and _plain(sin, (batch, 1, d), self.dtype)
              and _plain(meta.slot_mapping, (batch,), torch.int64))
        if decodes:
            ok = ok and (tables is not None and lens is not None and _plain(lens, (decodes,), torch.int64)
                         and tables.dim() == 2 and _plain(tables, (decodes, tables.shape[1]), torch.int64))
        info: list[int] = []  # per chunk: rows, first position, where its blocks start in `blocks`
        block_lists: list[torch.Tensor] = []
        at = most = 0
        for c in meta.chunks:
            n_blocks = -(-c.context_len // self._model.block_size)
            ok = ok and _plain(c.block_ids, (n_blocks,), torch.int64)
            info += [c.query_len, c.start_position, at]
            block_lists.append(c.block_ids)
            at, most = at + n_blocks, max(most, n_blocks)
        ok = ok and decodes + sum(c.query_len for c in meta.chunks) == batch
        chunk_info = torch.tensor(info, dtype=torch.int64) if info else None
        blocks = (block_lists[0] if len(block_lists) == 1 else torch.cat(block_lists)) if block_lists else None
        need = 2 * self.config.num_kv_heads * most * self._model.block_size * d
        if self._chunk_kv.numel() < need:
            self._chunk_kv = torch.empty(need, dtype=self.dtype)
        if not ok:
            raise ValueError("decode stack: operands not as the kernels read them (shapes, dtypes, contiguity)")
        lib = _LOADER.load()
        assert lib is not None
        out = embeddings.new_empty(batch, self.config.hidden_size)
        step = _Step(batch=batch, embeddings=embeddings.data_ptr(), cos=cos.data_ptr(), sin=sin.data_ptr(),
                     slots=meta.slot_mapping.data_ptr(),
                     block_tables=tables.data_ptr() if decodes and tables is not None else None,
                     table_width=tables.shape[1] if decodes and tables is not None else 0,
                     context_lens=lens.data_ptr() if decodes and lens is not None else None, out=out.data_ptr(),
                     workspace=self._workspace.data_ptr(), threads=torch.get_num_threads(), decodes=decodes,
                     chunks=len(meta.chunks), chunk_info=chunk_info.data_ptr() if chunk_info is not None else None,
                     chunk_blocks=blocks.data_ptr() if blocks is not None else None,
                     chunk_kv=self._chunk_kv.data_ptr() if meta.chunks else None,
                     chunk_attention=self._chunk_kernel if meta.chunks else None)
        rc = lib.cf_decode_stack(ctypes.byref(self._model), ctypes.byref(step))
        if rc:
            raise RuntimeError(f"decode stack: a kernel refused its operands (code {rc}: layer {rc // 100 - 1}, "
                               f"call {rc % 100})")
        return out


def build_decode_stack(config: StackConfig, layers: Sequence[StackLayer], final_norm: torch.Tensor,
                       dtype: torch.dtype) -> DecodeStack | None:
    """The stack over these (loaded, packed) layers, or None where a piece is not as it reads it."""
    if dtype not in (torch.float32, torch.bfloat16) or not layers or not packed_gemv.cpu_has_avx512():
        return None
    kernels = _kernels()
    if kernels is None:
        return None
    h, d = config.hidden_size, config.head_dim
    heads = config.num_heads + config.num_kv_heads
    if config.num_heads // config.num_kv_heads > paged_decode_cpu.MAX_GROUP or d > paged_decode_cpu.MAX_HEAD_DIM:
        return None
    keep: list[torch.Tensor] = [final_norm]
    built: list[_Layer] = []
    halves = dtype == torch.bfloat16
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        if attn.qk_norm_weight is None:
            attn.fuse_qk_norms()
        norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight, attn.qk_norm_weight)
        if not all(_plain(w, shape, dtype) for w, shape in zip(norms, ((h,), (h,), (heads, d)), strict=True)):
            return None
        gate_up = mlp.gate_up_proj
        if not isinstance(gate_up, GateUpLinear) or not isinstance(attn.qkv_proj, Linear):
            return None
        if not isinstance(attn.o_proj, Linear) or not isinstance(mlp.down_proj, Linear):
            return None
        if halves:
            if gate_up.packed_halves is None:
                return None
            gate = _weight(gate_up, gate_up.packed_halves[0], gate_up.halves_layout, dtype)
            up = _weight(gate_up, gate_up.packed_halves[1], gate_up.halves_layout, dtype)
            keep.extend(gate_up.packed_halves)
        else:
            gate = _weight(gate_up, gate_up.packed, gate_up.packed_layout, dtype)
            up = _Weight()
        weights = [_weight(lin, lin.packed, lin.packed_layout, dtype) for lin in (attn.qkv_proj, attn.o_proj,
                                                                                   mlp.down_proj)]
        qkv, o, down = weights
        if gate is None or up is None or qkv is None or o is None or down is None:
            return None
        keep.extend(t for t in (*norms, attn.qkv_proj.packed, attn.o_proj.packed, mlp.down_proj.packed,
                                gate_up.packed, attn.qkv_proj.bias, attn.o_proj.bias) if t is not None)
        input_norm, post_norm, qk_norm = norms
        assert qk_norm is not None
        built.append(_Layer(input_norm=input_norm.data_ptr(), post_norm=post_norm.data_ptr(),
                            qk_norm=qk_norm.data_ptr(), qkv=qkv, o=o, gate=gate, up=up, down=down))
    if not _plain(final_norm, (h,), dtype):
        return None
    return DecodeStack(config, dtype, built, final_norm, halves, keep, kernels, list(layers))
