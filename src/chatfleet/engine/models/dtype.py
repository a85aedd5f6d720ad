"""The compute dtype a model runs in when the user asks for ``auto``.

On a CPU: bfloat16 where the CPU computes it natively (AVX-512 BF16 or AMX BF16, which oneDNN
uses for the linears, at 2-3x float32's rate), else float32 (an emulated bfloat16 is slower than
float32). On CUDA: the checkpoint's ``torch_dtype`` (float32 when it names none).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch

DTYPE_NAMES = ("float32", "bfloat16", "float16")
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The flags of the first CPU in /proc/cpuinfo (empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


def native_bf16(device: torch.device) -> bool:
    """Whether ``device`` computes bfloat16 natively (and, on a CPU, oneDNN runs it)."""
    if device.type == "cuda":
        return bool(torch.cuda.is_bf16_supported())
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()) and any(f in cpu_flags() for f in NATIVE_BF16_FLAGS)


def auto_dtype(device: torch.device, checkpoint_dtype: object = None) -> str:
    """The dtype ``auto`` stands for on ``device``; ``checkpoint_dtype`` is config.json's
    ``torch_dtype`` (or ``dtype``), used on CUDA."""
    if device.type == "cuda":
        name = str(checkpoint_dtype).removeprefix("torch.") if checkpoint_dtype else "float32"
        return name if name in DTYPE_NAMES else "float32"
    return "bfloat16" if native_bf16(device) else "float32"


def dtype_for_auto(device: str, model_folder: Path | None = None) -> str:
    """``--dtype auto`` on a resolved device name (``cpu``, ``cuda:0``); ``model_folder`` is read
    (its config.json's ``torch_dtype``) only on CUDA."""
    dev = torch.device(device)
    checkpoint = None
    if dev.type == "cuda" and model_folder is not None and (model_folder / "config.json").is_file():
        hf = json.loads((model_folder / "config.json").read_text())
        checkpoint = hf.get("torch_dtype") or hf.get("dtype")
    return auto_dtype(dev, checkpoint)
