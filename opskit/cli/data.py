"""``opskit data prepare NAME``: tokenizer + Megatron indexed dataset for a spec's corpus."""

from __future__ import annotations

import typer

from opskit.cli._common import JsonOutput, SpecName, console, emit, friendly_errors, progress_console

app = typer.Typer(help="Prepare training data.", no_args_is_help=True)


@app.command("prepare")
@friendly_errors(extra="train")  # megatron-core's dataset builder, torch, numpy and tokenizers: the trainer's
def prepare(
    name: SpecName,
    force: bool = typer.Option(False, "--force", help="Rebuild over a dataset opskit prepared in data.dir for other "
                                                      "inputs or settings (never a folder opskit did not write)."),
    json_output: JsonOutput = False,
) -> None:
    """Train the spec's BPE tokenizer and write its indexed dataset (skipped when already up to date). data.dir must
    be new, empty or opskit's own. JSON: tokenizer_dir, data_prefix, num_documents, num_tokens, vocab_size, reused."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from opskit.data.corpus import prepare_data
    from opskit.run.paths import corpus_inputs
    from opskit.spec.load import load_spec

    spec = load_spec(name)
    corpus, output_dir = corpus_inputs(spec)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=progress_console(json_output), transient=True) as bar:
        tasks: dict[str, int] = {}

        def progress(stage: str, done: int, total: int) -> None:
            if stage not in tasks:
                tasks[stage] = bar.add_task(stage, total=total)
            bar.update(tasks[stage], completed=done, total=total)

        result = prepare_data(corpus, output_dir, spec.data.vocab_size, name=spec.data.name, progress=progress,
                              force=force)
    emit(result, json_output, _render)


def _render(result) -> None:
    verb = "up to date" if result.reused else "prepared"
    console.print(f"data {verb}: {result.num_documents} documents, {result.num_tokens:,} tokens, "
                  f"vocab {result.vocab_size}")
    console.print(f"  --data-path {result.data_prefix}")
    console.print(f"  --tokenizer-name-or-path {result.tokenizer_dir}")
