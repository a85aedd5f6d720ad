"""The engine's GPU kernels, each with a torch reference and a dispatcher that falls back to it.

| kernel | dispatcher | reference (what the engine computes today) |
|---|---|---|
| paged decode attention | ``paged_decode.paged_decode_attention`` | ``decode_attention`` over ``build_decode_groups`` |
| KV store into slots | ``kv_store.store_kv`` | ``KVCache.write`` |
| paged prefill attention | ``paged_prefill.paged_prefill_attention`` | ``chunk_attention`` over the gathered context |
| block-scaled FP8 GEMM | ``fp8_gemm.fp8_block_linear`` | ``dequantize_weight`` + ``F.linear`` |
| MoE top-k softmax | ``moe_router.topk_softmax`` | ``Router.forward``'s softmax/top-k/renormalise |
| grouped expert GEMM | ``grouped_gemm.grouped_gemm`` (``moe_experts.expert_mlp``) | one ``F.linear`` per expert |

Every dispatcher takes ``backend="auto" | "torch" | "triton"`` (``backend.py``): ``auto`` runs
the Triton kernel on CUDA tensors when Triton is installed and the call is one the kernel
supports, the reference otherwise, so a CPU install (no Triton, no GPU) runs exactly what it
ran before. The ``*_triton.py`` modules import Triton and are imported only when a kernel runs.
Attention softcapping has no engine code yet (Gemma 4 configs with it are refused); its
reference is ``attention_params.dense_attention``.
"""
