"""``opskit ckpt``: convert Megatron-DeepSpeed checkpoints to Hugging Face, and sample from the result."""

from __future__ import annotations

from pathlib import Path

import typer

from opskit.cli._common import console, friendly_errors

app = typer.Typer(help="Megatron-DeepSpeed checkpoints: convert, generate.", no_args_is_help=True)


def _checkpoint_dir(run_or_dir: str) -> tuple[Path, Path | None]:
    """(checkpoint dir, run root or None): an existing path is taken as is, anything else as a spec name."""
    path = Path(run_or_dir)
    if path.exists():
        return path, None
    from opskit.runs import RunPaths
    from opskit.spec import load_spec

    run = RunPaths.of(load_spec(run_or_dir))
    return run.checkpoints, run.root


@app.command("convert")
@friendly_errors
def convert(
    run_or_dir: str = typer.Argument(..., help="Spec name, checkpoint dir (with 'latest') or global_stepN folder."),
    step: int = typer.Option(None, "--step", help="Convert global_stepN instead of 'latest'."),
    out: Path = typer.Option(None, "--out", help="Output folder (default: <run>/hf/global_stepN)."),
    dtype: str = typer.Option("fp32", "--dtype", help="fp32, fp16 or bf16."),
    tokenizer: Path = typer.Option(None, "--tokenizer", help="Tokenizer folder (default: the one the run used)."),
) -> None:
    """Merge TP/PP shards of one step into a Hugging Face BloomForCausalLM folder (safetensors)."""
    from opskit.ckpt.convert import convert_to_bloom
    from opskit.ckpt.layout import resolve_step_dir

    directory, run_root = _checkpoint_dir(run_or_dir)
    step_dir = resolve_step_dir(directory, step)
    if out is None:
        out = (run_root or directory.parent) / "hf" / step_dir.name
    with console.status(f"converting {step_dir}"):
        result = convert_to_bloom(step_dir, out, dtype=dtype, tokenizer_dir=tokenizer)
    console.print(f"converted {result.step_dir} (iteration {result.iteration}, {result.num_parameters:,} parameters)"
                  f" -> {result.out_dir}")


@app.command("generate")
@friendly_errors
def generate(
    model_dir: Path = typer.Argument(..., help="A Hugging Face model folder (e.g. from `opskit ckpt convert`)."),
    prompt: str = typer.Option("And God said", "--prompt"),
    max_new_tokens: int = typer.Option(40, "--max-new-tokens", min=1),
    seed: int = typer.Option(0, "--seed"),
) -> None:
    """Sample a continuation of PROMPT with transformers."""
    from opskit.ckpt.generate import generate as sample

    console.print(sample(model_dir, prompt, max_new_tokens, seed), markup=False)
