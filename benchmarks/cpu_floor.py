"""The machine's floor for a decode step, measured where it runs (issue 20, point 4).

Two numbers bound a step from below:
  * matmul peak: FLOP/s of a large square GEMM in the model's dtype with the threads the run uses
    (oneDNN/AMX for bfloat16 where the CPU has it);
  * memory bandwidth: bytes read + written per second by a tensor copy, and bytes read per second
    by a sum (reads only), at the size of the step's working set (weights + KV read), and the copy
    at a size past the caches; the floor takes the faster of copy and read at the working set
    (a step mostly reads, and a floor must not be slower than what a rival engine achieves).
A decode step at batch B must read every weight once and each sequence's KV, and compute about
2 x params x B FLOPs plus attention, so its floor is max(bytes / bandwidth, FLOPs / peak).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch

GEMM_SIZE = 2048
DRAM_COPY_BYTES = 1 << 30  # past any L3 these machines report


@dataclass(frozen=True)
class Floor:
    dtype: str
    threads: int
    matmul_flops_per_s: float  # measured peak for `dtype`
    gemm_size: int
    copy_bytes_per_s: float  # (read + written) / s of a copy at the working-set size
    read_bytes_per_s: float  # read / s of a sum at the working-set size
    copy_working_set_bytes: int
    dram_copy_bytes_per_s: float  # at DRAM_COPY_BYTES (for reference)

    @property
    def bandwidth(self) -> float:
        """What the floor divides the step's bytes by: the faster of copy and read."""
        return max(self.copy_bytes_per_s, self.read_bytes_per_s)

    def as_dict(self) -> dict:
        return {**asdict(self), "floor_bytes_per_s": self.bandwidth}


@dataclass(frozen=True)
class StepWork:
    """What one decode step must do at a batch: bytes it reads and FLOPs it computes."""

    batch: int
    context: int
    weight_bytes: int
    kv_bytes: int
    flops: float

    @property
    def bytes_read(self) -> int:
        return self.weight_bytes + self.kv_bytes


def _best_seconds(fn, reps: int) -> float:  # noqa: ANN001 - a no-argument callable
    fn()  # warm-up: allocation, oneDNN primitive creation
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def matmul_peak(dtype: torch.dtype, n: int = GEMM_SIZE, reps: int = 8) -> float:
    """FLOP/s of an n x n x n product in `dtype` with torch's current thread count: the faster of
    ``torch.mm`` (MKL for float32, which takes its AVX2 path on AMD CPUs) and oneDNN with the
    weight prepacked (what the engine's linears run; 2.4x MKL's float32 rate on an AVX-512 EPYC)."""
    a = torch.randn(n, n).to(dtype)
    b = torch.randn(n, n).to(dtype)
    out = torch.empty(n, n, dtype=dtype)
    with torch.inference_mode():
        seconds = _best_seconds(lambda: torch.mm(a, b, out=out), reps)
        if torch.backends.mkldnn.is_available() and dtype in (torch.float32, torch.bfloat16):
            try:
                packed = torch.ops.mkldnn._reorder_linear_weight(b.t().contiguous(), None)
                seconds = min(seconds, _best_seconds(
                    lambda: torch.ops.mkldnn._linear_pointwise(a, packed, None, "none", [], ""), reps))
            except RuntimeError:  # no oneDNN kernel for this dtype here
                pass
    return 2.0 * n ** 3 / seconds


def copy_bandwidth(nbytes: int, reps: int = 10) -> float:
    """(read + written) bytes per second of one tensor copy of `nbytes`."""
    n = max(1, nbytes // 4)
    src = torch.ones(n, dtype=torch.float32)
    dst = torch.empty_like(src)
    seconds = _best_seconds(lambda: dst.copy_(src), reps)
    return 2.0 * n * 4 / seconds


def read_bandwidth(nbytes: int, reps: int = 10) -> float:
    """Bytes read per second by a sum over `nbytes` of float32 (compute is negligible beside it)."""
    x = torch.ones(max(1, nbytes // 4), dtype=torch.float32)
    with torch.inference_mode():
        seconds = _best_seconds(lambda: x.sum(), reps)
    return x.numel() * 4 / seconds


def measure_floor(dtype: torch.dtype, working_set_bytes: int) -> Floor:
    return Floor(
        dtype=str(dtype).removeprefix("torch."),
        threads=torch.get_num_threads(),
        matmul_flops_per_s=matmul_peak(dtype),
        gemm_size=GEMM_SIZE,
        copy_bytes_per_s=copy_bandwidth(working_set_bytes),
        read_bytes_per_s=read_bandwidth(working_set_bytes),
        copy_working_set_bytes=working_set_bytes,
        dram_copy_bytes_per_s=copy_bandwidth(DRAM_COPY_BYTES, reps=3),
    )


def decode_work(cfg, batch: int, context: int, weight_bytes_per_param: float,  # noqa: ANN001 - Qwen3Config
                kv_bytes_per_token: int) -> StepWork:
    """A dense Qwen3-style decode step: every linear weight and the LM head read once, each
    sequence's KV read once; 2 FLOPs per weight per token plus QK and PV over the context."""
    h, heads, kv_heads, d = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    per_layer = h * (heads + 2 * kv_heads) * d + heads * d * h + 3 * h * cfg.intermediate_size
    linear_params = cfg.num_layers * per_layer + cfg.vocab_size * h  # + the LM head
    attention_flops = 4.0 * cfg.num_layers * heads * d * context * batch
    return StepWork(
        batch=batch,
        context=context,
        weight_bytes=int(linear_params * weight_bytes_per_param),
        kv_bytes=batch * context * kv_bytes_per_token,
        flops=2.0 * linear_params * batch + attention_flops,
    )


def against_floor(step_s: float, work: StepWork, floor: Floor, cpu_s: float | None = None) -> dict:
    """The step's floor (the slower of reading its bytes and computing its FLOPs) and the
    measured step as a multiple of it; `cpu_s` (one thread: the step's CPU time, which a loaded
    machine does not stretch) as a multiple too."""
    bytes_s = work.bytes_read / floor.bandwidth
    flops_s = work.flops / floor.matmul_flops_per_s
    floor_s = max(bytes_s, flops_s)
    return {
        "bytes_read": work.bytes_read,
        "flops": work.flops,
        "bytes_bound_ms": bytes_s * 1e3,
        "flops_bound_ms": flops_s * 1e3,
        "floor_ms": floor_s * 1e3,
        "bound_by": "memory" if bytes_s >= flops_s else "compute",
        "step_over_floor": step_s / floor_s,
        "cpu_step_over_floor": None if cpu_s is None else cpu_s / floor_s,
    }
