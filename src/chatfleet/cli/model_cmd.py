"""`chatfleet model ...`: build the built-in tiny models."""

from __future__ import annotations

import time
from pathlib import Path

import typer

from chatfleet.errors import ChatfleetError, ConfigError

SIZE_NAMES = ("tiny", "small")  # chatfleet.engine.builtin_models.tiny.SIZES, named here so --help needs no torch

model_app = typer.Typer(help="Build and inspect local models.", no_args_is_help=True)


@model_app.command("tiny")
def tiny(
    out: Path = typer.Option(..., "--out", help="Folder to write the Hugging Face model into."),
    size: str = typer.Option("tiny", "--size", help=f"One of: {', '.join(SIZE_NAMES)}."),
    seed: int = typer.Option(0, "--seed", help="Seed of the random weights."),
    fp8: bool = typer.Option(
        False, "--fp8", help="Write an FP8 checkpoint (e4m3 linears, block-wise [128,128] weight_scale_inv)."
    ),
    arch: str = typer.Option("qwen3", "--arch", help="qwen3 or gemma4."),
    moe: bool = typer.Option(False, "--moe", help="gemma4: the mixture-of-experts variant."),
    multimodal: bool = typer.Option(False, "--multimodal",
                                    help="gemma4: a Gemma4ForConditionalGeneration folder with a vision tower."),
) -> None:
    """Build a model with seeded random weights and a local BPE tokenizer (Qwen3 or Gemma 4 layout)."""
    from chatfleet.engine.builtin_models.tiny import build_tiny_model
    from chatfleet.engine.builtin_models.tiny_gemma4 import build_tiny_gemma4
    from chatfleet.engine.models.fp8_format import FP8WeightFormat

    start = time.perf_counter()
    try:
        if arch == "gemma4":
            if fp8:
                raise ConfigError("--fp8 is not available for --arch gemma4")
            path = build_tiny_gemma4(out, size=size, moe=moe, multimodal=multimodal, seed=seed)
        elif arch != "qwen3":
            raise ConfigError(f"unknown --arch {arch!r}; valid: qwen3, gemma4")
        elif moe or multimodal:
            raise ConfigError("--moe and --multimodal need --arch gemma4")
        else:
            path = build_tiny_model(out, size=size, seed=seed, fp8=FP8WeightFormat() if fp8 else None)
    except ChatfleetError as e:
        typer.echo(f"error: {e.message}", err=True)
        raise typer.Exit(2) from None
    kind = " FP8" if fp8 else ""
    typer.echo(f"built {arch} {size}{kind} model (seed {seed}) in {path} in {time.perf_counter() - start:.1f} s")


def register(app: typer.Typer) -> None:
    """Add the `model` command group to `app`."""
    app.add_typer(model_app, name="model")
