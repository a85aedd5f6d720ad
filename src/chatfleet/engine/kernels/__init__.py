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
Who calls them: the runner's kernels path (``engine/runner/torch_runner.py``, the default on
CUDA): ``step_attention.py`` builds a step's int32 block tables, context lengths and query
offsets once and runs every layer's attention through the KV store and the paged decode /
prefill dispatchers (handed to the model inside its ``AttentionMetadata``: the models never
import this package); ``fp8_gemm.fp8_block_linear`` is handed to the FP8 linears
(``models/fp8_model.use_block_gemm``) and ``moe_experts.use_grouped_experts`` stacks each MoE
block's experts for the grouped GEMM. On the CPU the same path runs the references.
Attention softcapping has no engine code yet (Gemma 4 configs with it are refused); its
reference is ``attention_params.dense_attention``.
"""
