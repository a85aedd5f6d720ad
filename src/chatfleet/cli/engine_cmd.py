"""`chatfleet engine`: serve a model with the built-in engine over OpenAI-compatible HTTP."""

from __future__ import annotations

from typing import Any

import typer
from typer.core import TyperCommand

from chatfleet.cli.errors import check_port
from chatfleet.engine.api.options import API_KEY_ENV, ServerOptions
from chatfleet.engine.argv import EngineServer
from chatfleet.engine.config import CacheConfig, EngineConfig, SchedulerConfig, parse_memory_size
from chatfleet.engine.serve import serve_engine
from chatfleet.errors import ChatfleetError

_E, _C, _S, _O = EngineConfig(), CacheConfig(), SchedulerConfig(), ServerOptions()


def engine(
    model: str = typer.Option(_E.model, "--model", help="Local HF folder, or 'tiny' / 'small' (built once)."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to bind."),
    port: int = typer.Option(8000, "--port", help="Port to bind."),
    dtype: str = typer.Option(_E.dtype, "--dtype", help="float32, bfloat16, float16 or auto (bfloat16 where "
                              "the CPU computes it natively, else float32; on CUDA the checkpoint's)."),
    device: str = typer.Option(_E.device, "--device", help="auto (CUDA when present), cpu, cuda or cuda:N."),
    gpu_memory_utilization: float | None = typer.Option(
        None, "--gpu-memory-utilization",
        help="GPU: share of the card for weights, activations and KV; the KV pool gets what a profile "
             "pass at the step budget leaves (instead of --kv-cache-tokens / --kv-cache-memory).",
    ),
    enforce_eager: bool = typer.Option(
        False, "--enforce-eager", help="GPU: run decode steps eagerly (no CUDA graphs)."
    ),
    kernels: str = typer.Option(
        _E.kernels, "--kernels", help="Model kernels: auto (oneDNN on CPU where available), onednn or torch."
    ),
    decode_kernel: str = typer.Option(
        _E.decode_kernel, "--decode-kernel",
        help="CPU decode attention: auto (a C++ kernel reading K/V in place, built at start where a "
             "compiler is found), cpp or torch (torch ops).",
    ),
    kv_cache_dtype: str = typer.Option(
        _E.kv_cache_dtype, "--kv-cache-dtype",
        help="KV cache dtype: auto (the model's), float32, bfloat16, float16, fp8.",
    ),
    kv_scales_from_prompts: int | None = typer.Option(
        None, "--kv-scales-from-prompts", help="FP8 cache: measure K/V scales from the first N prompt tokens."
    ),
    quantization: str | None = typer.Option(
        None, "--quantization", help="fp8: quantize a 16/32-bit checkpoint's linears block-wise at load."
    ),
    embedding_dtype: str = typer.Option(
        _E.embedding_dtype, "--embedding-dtype", help="auto (the model's dtype) or fp8 (per-row scales)."
    ),
    language_model_only: bool = typer.Option(
        _E.language_model_only, "--language-model-only/--no-language-model-only",
        help="Multimodal checkpoints: serve text only, never reading the vision/audio towers "
             "(on: image and audio input are not served).",
    ),
    kv_cache_tokens: int | None = typer.Option(None, "--kv-cache-tokens", help="KV pool size in tokens."),
    kv_cache_memory: str | None = typer.Option(
        None, "--kv-cache-memory", help="KV pool size in bytes or with a unit, e.g. 2GiB."
    ),
    block_size: int = typer.Option(_C.block_size, "--block-size", help="Tokens per KV block."),
    sliding_memory_fraction: float | None = typer.Option(
        None, "--sliding-memory-fraction",
        help="Sliding-window/full-attention models: share of KV memory for the sliding-window layers' pool "
             "(default: in proportion to what one long request needs per layer group).",
    ),
    keep_slid_out_blocks: bool = typer.Option(
        _C.keep_slid_out_blocks, "--keep-slid-out-blocks/--no-keep-slid-out-blocks",
        help="Blocks that slid out of the window stay cached for the next turn (else freed at once).",
    ),
    no_prefix_cache: bool = typer.Option(False, "--no-prefix-cache", help="Turn prefix caching off."),
    host_cache_memory: str | None = typer.Option(
        None, "--host-cache-memory",
        help="Host-memory KV tier (bytes or with a unit, e.g. 12GiB): device evictions demote there.",
    ),
    eviction_policy: str = typer.Option(
        _C.eviction_policy, "--eviction-policy", help="Device KV pool eviction: lru, lfu or session."
    ),
    host_eviction_policy: str = typer.Option(
        _C.host_eviction_policy, "--host-eviction-policy", help="Host tier eviction: lru, lfu or session."
    ),
    scheduling_policy: str = typer.Option(
        _S.policy, "--scheduling-policy", help="Waiting-queue order: fcfs or lpm (longest cached prefix first)."
    ),
    max_queue_delay: float = typer.Option(
        _S.max_queue_delay, "--max-queue-delay", help="Seconds after which a waiting request goes first (lpm)."
    ),
    lpm_host_weight: float = typer.Option(
        _S.lpm_host_weight, "--lpm-host-weight", help="lpm: a host-tier hit token counts this much of a device hit."
    ),
    max_batched_tokens: int = typer.Option(
        _S.max_batched_tokens, "--max-batched-tokens", help="Per-step token budget (chunked prefill)."
    ),
    mixed_step_tokens: int | None = typer.Option(
        _S.mixed_step_tokens, "--mixed-step-tokens",
        help="Token budget of a step that carries decode rows (default: --max-batched-tokens).",
    ),
    no_chunked_prefill: bool = typer.Option(
        False, "--no-chunked-prefill", help="Prefill a prompt in one step of its own (split only if over the budget)."
    ),
    max_running: int = typer.Option(_S.max_running, "--max-running", help="Most requests in the batch."),
    max_waiting: int = typer.Option(
        _S.max_waiting, "--max-waiting", help="Waiting-queue bound; beyond it requests get 503."
    ),
    max_model_len: int | None = typer.Option(
        None, "--max-model-len", help="Context length (default: the model's)."
    ),
    threads: int | None = typer.Option(None, "--threads", help="torch intra-op threads."),
    served_model_name: str | None = typer.Option(
        None, "--served-model-name", help="Model name clients use (default: from --model)."
    ),
    seed: int = typer.Option(_E.seed, "--seed", help="Engine seed."),
    max_body_bytes: int = typer.Option(
        _O.max_body_bytes, "--max-body-bytes", help="Largest request body; larger ones get 413."
    ),
    request_timeout: float | None = typer.Option(
        None, "--request-timeout", help="Seconds a request may take in all (queue + generation); then 408."
    ),
    api_key: str | None = typer.Option(
        None, "--api-key", help=f"Bearer key(s), comma-separated, every route but /health and /metrics"
        f" requires (default: ${API_KEY_ENV})."
    ),
    enable_admin_api: bool = typer.Option(
        False, "--enable-admin-api", help="Serve admin routes (/reset_prefix_cache), behind the API key."
    ),
    engine_process: bool = typer.Option(
        _O.engine_process, "--engine-process/--no-engine-process",
        help="Run the engine core (scheduler, model) in a process of its own, apart from the HTTP work.",
    ),
    log_level: str = typer.Option("info", "--log-level", help="uvicorn log level."),
) -> None:
    """Start the built-in engine on HOST:PORT (OpenAI /v1/chat/completions, /v1/completions, ...)."""
    try:
        config = EngineConfig(
            model=model,
            served_model_name=served_model_name,
            dtype=dtype,
            kernels=kernels,
            decode_kernel=decode_kernel,
            seed=seed,
            max_model_len=max_model_len,
            num_threads=threads,
            kv_cache_dtype=kv_cache_dtype,
            kv_scales_from_prompts=kv_scales_from_prompts,
            quantization=quantization,
            embedding_dtype=embedding_dtype,
            language_model_only=language_model_only,
            device=device,
            gpu_memory_utilization=gpu_memory_utilization,
            enforce_eager=enforce_eager,
            cache=CacheConfig(
                block_size=block_size,
                num_tokens=kv_cache_tokens,
                memory_bytes=parse_memory_size(kv_cache_memory) if kv_cache_memory else None,
                enable_prefix_caching=not no_prefix_cache,
                eviction_policy=eviction_policy,
                host_memory_bytes=parse_memory_size(host_cache_memory) if host_cache_memory else 0,
                host_eviction_policy=host_eviction_policy,
                sliding_memory_fraction=sliding_memory_fraction,
                keep_slid_out_blocks=keep_slid_out_blocks,
            ),
            scheduler=SchedulerConfig(
                max_batched_tokens=max_batched_tokens,
                mixed_step_tokens=mixed_step_tokens,
                max_running=max_running,
                max_waiting=max_waiting,
                enable_chunked_prefill=not no_chunked_prefill,
                policy=scheduling_policy,
                max_queue_delay=max_queue_delay,
                lpm_host_weight=lpm_host_weight,
            ),
        )
        options = ServerOptions(
            max_body_bytes=max_body_bytes, request_timeout_s=request_timeout,
            api_keys=ServerOptions.keys_from(api_key), enable_admin_api=enable_admin_api,
            engine_process=engine_process,
        )
        server = EngineServer(host=host, port=port, log_level=log_level, options=options)
        check_port(host, port)
        serve_engine(config, server)
    except ChatfleetError as e:
        typer.echo(f"error: {e.message}", err=True)
        raise typer.Exit(2) from None


class PlainHelpCommand(TyperCommand):
    """A command whose ``--help`` is click's plain two-column list instead of rich's table.

    The engine has some forty flags, several over 20 characters and two ``--x/--no-x`` pairs:
    at 80 columns rich's table shrinks its name, negative-name and help columns to one width
    each (about 20) and cuts the longer flag names with an ellipsis. Click's list puts a long
    name on its own line and wraps the help under it, so every flag reads in full."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.rich_markup_mode = None


def register(app: typer.Typer) -> None:
    """Add the `engine` command to `app`."""
    app.command("engine", cls=PlainHelpCommand)(engine)
