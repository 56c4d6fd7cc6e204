"""``opskit ckpt``: list, inspect, check, convert, reshape, prune, back up Megatron-DeepSpeed checkpoints; sample from a
converted model. Nothing here imports torch at import time."""

from __future__ import annotations

from pathlib import Path

import typer

from opskit.cli._common import (
    JsonOutput,
    console,
    emit,
    err_console,
    friendly_errors,
    print_lines,
    progress_console,
)
from opskit.run.paths import checkpoint_dir_of

app = typer.Typer(help="Megatron-DeepSpeed checkpoints: list, inspect, check, convert, reshape, prune, backup, "
                       "restore, generate.",
                  no_args_is_help=True)


def _human(nbytes: int) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if nbytes < 1024 or unit == "TB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return ""


def _progress(in_bytes: bool = True):
    """A rich progress bar on stderr (bytes with speed, or a count), shown only on a terminal."""
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    amounts = (DownloadColumn(), TransferSpeedColumn()) if in_bytes else (MofNCompleteColumn(),)
    return Progress(TextColumn("{task.description}"), BarColumn(), *amounts, TimeRemainingColumn(),
                    console=err_console, transient=True, disable=not err_console.is_terminal)


def _weights_only_note(step_dir: Path | str, what: str) -> None:
    """The one stderr line of a command that read a weights-only backup's copy of a step
    (:func:`opskit.ckpt.format.manifest.weights_only_copy`)."""
    err_console.print(f"note: {step_dir}: a weights-only backup (no optimizer states): {what}; it cannot resume "
                      "training")


@app.command("list")
@friendly_errors
def list_(
    run_or_dir: str = typer.Argument(..., help="Spec name or checkpoint dir (with global_stepN folders)."),
    json_output: JsonOutput = False,
) -> None:
    """Every global_stepN: size, TP/PP/DP, dtype, complete or not, consumed samples/tokens, which one is latest; then
    the universal folders (global_stepN_universal) and the step and layout each was converted from."""
    from opskit.ckpt.listing import list_checkpoint

    emit(list_checkpoint(checkpoint_dir_of(run_or_dir)[0]), json_output, _render_listing)


def _render_listing(listing) -> None:
    from opskit.ckpt.format.universal import origin_text

    directory, latest, unusable, steps = listing.directory, listing.latest, listing.latest_problem, listing.steps
    missing = " (no such step)" if latest and not any(s.latest for s in steps) else ""
    console.print(f"{directory}  latest: {latest or (f'unusable ({unusable})' if unusable else 'none')}{missing}")
    console.print(f"{'step':<18} {'size':>9} {'TP':>3} {'PP':>3} {'DP':>3} {'dtype':>5} {'complete':>8} "
                  f"{'consumed samples':>16} {'consumed tokens':>16}")
    for s in steps:
        degrees = (str(v) if v is not None else "?" for v in (s.tp, s.pp, s.dp))
        samples = f"{s.consumed_samples:,}" if s.consumed_samples is not None else "?"
        tokens = f"{s.consumed_tokens:,}" if s.consumed_tokens is not None else "?"
        console.print(f"{s.path.name:<18} {_human(s.size_bytes):>9} {' '.join(f'{d:>3}' for d in degrees)} "
                      f"{s.dtype or '?':>5} {'yes' if s.complete else 'NO':>8} {samples:>16} {tokens:>16}"
                      f"{'  <- latest' if s.latest else ''}")
    for s in steps:
        for problem in s.problems:
            console.print(f"{s.path.name}: {problem}")
    for path, origin in listing.universal.values():
        console.print(f"{path.name}  {origin_text(origin)}")


@app.command("inspect")
@friendly_errors
def inspect(
    step_dir: str = typer.Argument(..., help="A global_stepN folder, or a checkpoint dir (its 'latest')."),
    json_output: JsonOutput = False,
) -> None:
    """Architecture from the saved args, and every file's tensor names, shapes and dtypes (a step saved by a run
    resumed on another layout: the step it was reshaped from); exit 1 when the step is incomplete (its problems
    listed), unless it is a weights-only backup's copy of a complete step (a note says so). A universal folder
    (global_stepN_universal): what it was converted from."""
    from opskit.ckpt.listing import inspect_checkpoint

    inspection = inspect_checkpoint(step_dir)
    if inspection.step is not None and inspection.step["weights_only_backup"]:
        _weights_only_note(inspection.step["path"], "inspecting its weights")
    emit(inspection, json_output, _render_inspection)
    if not inspection.usable:
        raise typer.Exit(1)


def _render_inspection(inspection) -> None:
    from opskit.ckpt.format.universal import origin_text

    report = inspection.step
    if report is None:
        console.print(f"{inspection.path}: {origin_text(inspection.universal)}")
        return
    console.print(f"{report['path']}: iteration {report['step']}, consumed samples {report['consumed_samples']}, "
                  f"consumed tokens {report['consumed_tokens']}")
    if report["reshaped_from"]:
        console.print(f"  reshaped from {report['reshaped_from']} (resumed on another layout)")
    for key, value in report["architecture"].items():
        console.print(f"  {key}: {value}")
    for name, tensors in report["files"].items():
        if "size_bytes" in tensors:
            console.print(f"{name}  ({_human(tensors['size_bytes'])})")
            continue
        console.print(name)
        for key, t in tensors.items():
            console.print(f"  {key:48s} {str(t['shape']):>16s} {t['dtype']}")
    if not inspection.usable:
        for problem in report["problems"]:
            err_console.print(f"incomplete: {problem}")


@app.command("check")
@friendly_errors
def check(
    step_dir: str = typer.Argument(..., help="A global_stepN folder, a checkpoint dir (its 'latest'), or a spec "
                                             "name (its run's 'latest')."),
    crc: bool = typer.Option(True, "--crc/--no-crc", help="Read every file to its end and check its CRC-32s (finds "
                                                          "bytes changed inside tensor data)."),
    json_output: JsonOutput = False,
) -> None:
    """Completeness, every file's CRC-32s, TP consistency of replicated tensors, RNG agreement per pipeline stage,
    NaN/Inf. Exit 1 on any problem. A weights-only backup's copy of a step is checked without the optimizer shards
    its backup left out (a note says so): exit 0 means its weights are intact, not that it can resume."""
    from opskit.ckpt.check import check_step
    from opskit.ckpt.format.layout import resolve_step_dir

    with _progress(in_bytes=False) as bar:
        task = bar.add_task("checking", total=None)
        report = check_step(resolve_step_dir(checkpoint_dir_of(step_dir)[0]),
                            lambda done, total: bar.update(task, completed=done, total=total), crc=crc)
    if report.left_out:
        _weights_only_note(report.step, f"checked the files it has, not its {len(report.left_out)} optimizer shard(s)")
    emit(report, json_output, lambda checked: _render_check(checked, crc))
    if not report.ok:
        raise typer.Exit(1)


def _render_check(report, crc: bool) -> None:
    for problem in report.problems:
        console.print(f"incomplete: {problem}")
    for problem in report.corrupt:
        console.print(f"corrupt: {problem}")
    for d in report.tp_mismatches:
        console.print(f"TP mismatch: layer_{d['layer']:02d} {d['key']}: max abs diff {d['max_abs_diff']:.3g} "
                      f"(TP ranks {d['ranks']} vs 0)")
    for r in report.rng:
        if not r["agree"]:
            console.print(f"RNG mismatch: {r['key']} differs among the TP ranks of pipeline stage {r['pp']}")
    for n in report.nonfinite:
        console.print(f"non-finite: {n['file']} {n['key']}: {n['nan']} NaN, {n['inf']} Inf")
    if report.redundant:
        nbytes = report.redundant_bytes
        console.print(f"redundant copy: {len(report.redundant)} mp_rank file(s) hold {_human(nbytes)} ({nbytes:,} "
                      "bytes) of optimizer state that the optimizer shards hold already (saved by DeepSpeed "
                      "0.18.5-0.19.8 before opskit saved it once); the resume reads the shards only")
    verdict = ("OK, weights only" if report.left_out else "OK") if report.ok else "FAILED"
    console.print(f"{report.step}: {verdict} ({len(report.tp_diffs)} replicated tensors compared, "
                  f"{len(report.tp_mismatches)} differ; {len(report.rng)} RNG states compared"
                  + (f"; {_human(report.crc_bytes)} CRC-checked)" if crc else ")"))


@app.command("convert")
@friendly_errors(extra="convert")
def convert(
    run_or_dir: str = typer.Argument(..., help="Spec name, checkpoint dir (with 'latest') or global_stepN folder."),
    step: int = typer.Option(None, "--step", help="Convert global_stepN instead of 'latest'."),
    all_steps: bool = typer.Option(False, "--all", help="Every complete step; steps already converted intact from "
                                                          "the same save are skipped."),
    to: str = typer.Option("hf", "--to", help="Output format: hf (GPT2LMHeadModel or BloomForCausalLM)."),
    out: Path = typer.Option(None, "--out", help="Output folder (default <run>/hf/global_stepN; with --all the "
                                                 "parent folder)."),
    dtype: str = typer.Option(None, "--dtype", help="fp32, fp16 or bf16 (default: the checkpoint's)."),
    trim_vocab: bool = typer.Option(False, "--trim-vocab/--keep-padded-vocab",
                                    help="Drop Megatron's vocabulary padding (default: keep it)."),
    verify: bool = typer.Option(True, "--verify/--no-verify", help="Compare transformers' logits with the "
                                                                   "checkpoint's own forward."),
    verify_layers: int = typer.Option(None, "--verify-layers", min=1,
                                      help="Verify with the first N blocks only (default: all up to 1e9 parameters, "
                                           "else 2)."),
    max_shard_size: float = typer.Option(5.0, "--max-shard-size", help="GB per safetensors shard."),
    tokenizer: Path = typer.Option(None, "--tokenizer", help="Tokenizer folder (default: the one the run used)."),
    workers: int = typer.Option(None, "--workers", min=1, help="Blocks copied at once (threads; default 2)."),
    force: bool = typer.Option(False, "--force", help="Replace an output folder an earlier conversion wrote (never "
                                                      "a folder opskit did not write)."),
    json_output: JsonOutput = False,
) -> None:
    """Merge TP/PP shards into a Hugging Face folder (sharded safetensors, config, tokenizer), streaming. The output
    folder must be new or empty; the folder is built beside it and renamed into place. A complete step, or a
    weights-only backup's copy of one (a note says so). JSON: the steps converted (or already converted: skipped)
    and those not converted, with why."""
    from opskit.ckpt.convert import convert_checkpoint

    directory, run = checkpoint_dir_of(run_or_dir)
    with _progress() as bar:
        task = bar.add_task("converting", total=None)
        results = convert_checkpoint(directory, run.hf_dir, step, all_steps, out, to, dtype=dtype,
                                     trim_vocab=trim_vocab, tokenizer_dir=tokenizer, verify=verify,
                                     verify_layers=verify_layers, max_shard_bytes=int(max_shard_size * 1024**3),
                                     workers=workers, force=force,
                                     progress=lambda done, total: bar.update(task, completed=done, total=total))
    for left in results.not_converted:
        err_console.print(f"skipped: {left.reason}")
    for result in results.converted:
        if result.weights_only_backup:
            _weights_only_note(result.step_dir, "converted its weights")
        for name in result.averaged:
            err_console.print(f"warning: TP copies differ, averaged: {name}")
    emit(results, json_output, _render_conversions)


def _render_conversions(results) -> None:
    for result in results.converted:
        if result.skipped:
            console.print(f"skipped {result.step_dir}: already converted in {result.out_dir}")
            continue
        check = "" if result.max_abs_diff is None else f", verified: max abs logits diff {result.max_abs_diff:.2g}"
        if result.verified_layers is not None and result.verified_layers < result.num_layers:
            check += f" through {result.verified_layers} of {result.num_layers} blocks"
        console.print(f"converted {result.step_dir} (iteration {result.iteration}, {result.arch}, "
                      f"{result.num_parameters:,} parameters, {result.shards} shard(s){check}) -> {result.out_dir}")


@app.command("reshape")
@friendly_errors
def reshape(
    step_dir: str = typer.Argument(..., help="A global_stepN folder, or a checkpoint dir (its 'latest')."),
    tp: int = typer.Option(..., "--tp", min=1, help="Target tensor-parallel degree."),
    pp: int = typer.Option(..., "--pp", min=1, help="Target pipeline-parallel degree."),
    dp: int = typer.Option(..., "--dp", min=1, help="Target data-parallel degree."),
    out: Path = typer.Option(None, "--out", help="Write the universal folder here instead of beside the step (new or "
                                                 "empty). The trainer reads only <ckpt dir>/global_stepN_universal."),
    json_output: JsonOutput = False,
) -> None:
    """Convert a step for a resume on another TP x PP x DP layout, before submitting: DeepSpeed's universal
    checkpoint global_stepN_universal beside the step (what the trainer would write at start), verified against the
    step's weights. The step itself is only read. Nothing is written when the layout needs no conversion."""
    from opskit.ckpt.format.layout import resolve_step_dir
    from opskit.ckpt.format.universal import Layout
    from opskit.ckpt.reshape import reshape_step

    target = Layout(tp, pp, dp)
    with _progress(in_bytes=False) as bar:
        bar.add_task(f"converting to a universal checkpoint for {target} (DeepSpeed's ds_to_universal), verifying",
                     total=None)
        result = reshape_step(resolve_step_dir(step_dir), target, out)
    emit(result, json_output, _render_reshape)


def _render_reshape(result) -> None:
    target, name = result.target, result.step.path.name
    if result.universal is None:
        console.print(f"{name} was saved at {result.saved}; {target} needs no conversion ({result.why_not}); "
                      "nothing written")
        return
    console.print(f"{'reused' if result.reused else 'wrote'} {result.universal}: universal, from {name} at "
                  f"{result.saved} -> {target}; {result.verified} tensors verified against {name}'s weights")
    ckpt_dir = result.step.path.parent
    if not result.beside_step:
        console.print(f"the trainer reads only {ckpt_dir / (name + '_universal')}: move the folder there to resume "
                      "from it (or the trainer converts the step again)")
        return
    console.print(f"resume with --load {ckpt_dir} on {target}: the trainer reads {result.universal.name}"
                  + ("" if result.latest == name else f" (latest names {result.latest or 'no step'}: "
                                                       f"`opskit ckpt set-latest {ckpt_dir} {result.step.iteration}` "
                                                       "to resume from this one)"))


@app.command("prune")
@friendly_errors
def prune(
    run_or_dir: str = typer.Argument(..., help="Spec name or checkpoint dir."),
    keep: list[str] = typer.Option(..., "--keep", help="Keep-rule, repeatable: last:K, every:N, steps:N[,N...], "
                                                       "schedule:1-100/10,101-1000/18,1001-/1500 or schedule:tr1-13B."),
    dry_run: bool = typer.Option(False, "--dry-run", help="List what would be deleted; delete nothing."),
    force: bool = typer.Option(False, "--force", help="Also delete steps that no backup able to resume them (made "
                                                      "with --with-optim) still holds, with a warning (never latest)."),
    abandoned: bool = typer.Option(False, "--abandoned", help="Also delete the steps divergence rollbacks set aside "
                                                              "(global_stepN.abandoned-incidentK, as the run's "
                                                              "incidents.json records them)."),
    json_output: JsonOutput = False,
) -> None:
    """Delete the steps no keep-rule keeps (and the universal form opskit converted from a deleted step); never the
    step 'latest' names, nor (without --force) a step that no --with-optim backup still holds."""
    from opskit.ckpt.prune import parse_keep
    from opskit.ckpt.prune import prune as prune_steps
    from opskit.run.incidents import read_incidents

    directory, run = checkpoint_dir_of(run_or_dir)
    set_aside = [name for i in read_incidents(run) for name in i.get("abandoned", [])] if abandoned else []
    plan = prune_steps(directory, [parse_keep(k) for k in keep], dry_run=dry_run, force=force, abandoned=set_aside)
    for step, problem in plan.unbacked.items():
        err_console.print(f"warning: global_step{step} {'would be' if dry_run else 'was'} deleted with no backup that "
                          f"can resume it ({problem})")
    emit(plan, json_output, lambda pruned: _render_prune(pruned, dry_run))


def _render_prune(plan, dry_run: bool) -> None:
    for step, reasons in plan.keep.items():
        console.print(f"keep    global_step{step}  ({', '.join(reasons)})")
    for step, reason in plan.protected.items():
        console.print(f"keep    global_step{step}  ({reason})")
    for step in plan.delete:
        console.print(f"{'would delete' if dry_run else 'deleted'} global_step{step}")
    for folder in plan.universal:
        console.print(f"{'would delete' if dry_run else 'deleted'} {folder.name}  (its universal form)")
    for folder in plan.abandoned:
        console.print(f"{'would delete' if dry_run else 'deleted'} {folder.name}  (set aside by a rollback)")


@app.command("set-latest")
@friendly_errors
def set_latest(
    checkpoint_dir: Path = typer.Argument(..., help="Checkpoint dir (with global_stepN folders)."),
    step: int = typer.Argument(..., help="The step 'latest' should name."),
    json_output: JsonOutput = False,
) -> None:
    """Point 'latest' at global_stepN atomically, after checking that the step is complete. JSON: the file, what it
    named before (null: no latest) and now."""
    from opskit.ckpt.prune import set_latest as point_latest

    previous = point_latest(checkpoint_dir, step)
    emit({"latest": str(checkpoint_dir / "latest"), "previous": previous, "now": f"global_step{step}"}, json_output,
         lambda done: console.print(f"{checkpoint_dir}/latest: {previous or 'none'} -> {done['now']}"))


@app.command("backup")
@friendly_errors
def backup(
    run_or_dir: str = typer.Argument(..., help="Spec name or checkpoint dir."),
    to: str = typer.Option(..., "--to", help="Target: gs://bucket/prefix or file:///path."),
    steps: str = typer.Option(None, "--steps", help="Comma-separated steps (default: all)."),
    weights_only: bool = typer.Option(True, "--weights-only/--with-optim",
                                      help="Skip the ZeRO optimizer shards *_optim_states.pt (default)."),
    workers: int = typer.Option(4, "--workers", min=1, help="Parallel copies."),
    json_output: JsonOutput = False,
) -> None:
    """Copy steps with a CRC32C manifest, resumably and in parallel; verify every object; exit 1 if any fails."""
    from opskit.ckpt.backup import backup as back_up
    from opskit.ckpt.backup import parse_steps

    directory, _ = checkpoint_dir_of(run_or_dir)
    chosen = parse_steps(steps)
    with _progress() as bar:
        task = bar.add_task("backing up", total=None)
        results = back_up(directory, to, chosen, weights_only, workers,
                          progress=lambda key, nbytes: bar.update(task, advance=nbytes, description=key))
    emit(results, json_output, _render_backup)
    if not all(r.verified for r in results):
        raise typer.Exit(1)


def _render_backup(results) -> None:
    for r in results:
        state = "verified" if r.verified else "FAILED verification"
        console.print(f"{r.tag}: {len(r.copied)} copied, {len(r.skipped)} already there, {_human(r.bytes_total)}, "
                      f"{state}")
        for problem in r.problems:
            console.print(f"  {problem}")
    if unrecorded := next((r.unrecorded for r in results if r.unrecorded), None):
        console.print(f"note: {unrecorded}")


@app.command("verify")
@friendly_errors
def verify(
    url: str = typer.Argument(..., help="A backup made by `opskit ckpt backup` (gs://bucket/prefix or file:///path)."),
    json_output: JsonOutput = False,
) -> None:
    """Re-check every object of a backup against its manifests, and report every step folder without one as
    unverifiable; exit 1 on anything missing, corrupted or unverifiable."""
    from opskit.ckpt.backup import verify as verify_backup

    report = verify_backup(url)
    emit(report, json_output, _render_verify)
    if not report.ok:
        raise typer.Exit(1)


def _render_verify(report) -> None:
    for tag, problems in report.steps.items():
        console.print(f"{tag}: {'OK' if not problems else 'FAILED'}")
        for problem in problems:
            console.print(f"  {problem}")


@app.command("restore")
@friendly_errors
def restore(
    url: str = typer.Argument(..., help="A backup made by `opskit ckpt backup --with-optim` (gs://... or file:///...)."),
    run_or_dir: str = typer.Argument(..., help="Spec name or checkpoint dir to restore into."),
    step: int = typer.Option(None, "--step", help="The step to restore (default: the one the backup's latest names)."),
    json_output: JsonOutput = False,
) -> None:
    """Copy a backed-up step back as global_stepN, verified (CRC32C against its manifest, complete, CRC-32s) before it
    is renamed into place; never replaces a step. 'latest' is left as it is."""
    from opskit.ckpt.backup import restore as restore_step

    directory, _ = checkpoint_dir_of(run_or_dir)
    emit(restore_step(url, directory, step), json_output, lambda restored: _render_restore(restored, directory))


def _render_restore(result, directory: Path) -> None:
    console.print(f"restored {result.step}: {result.files} files, {_human(result.bytes_total)}, verified, complete")
    if result.latest != result.step.name:
        iteration = result.step.name.removeprefix("global_step")
        console.print(f"latest names {result.latest or 'no step'}: `opskit ckpt set-latest {directory} {iteration}` "
                      "to resume from it")


@app.command("publish")
@friendly_errors
def publish(
    run_or_dir: str = typer.Argument(..., help="Spec name or checkpoint dir."),
    to: str = typer.Option(..., "--to", help="hf://[datasets/]org/repo"),
    step: int = typer.Option(None, "--step", help="One converted step (default: every converted step)."),
    all_steps: bool = typer.Option(False, "--all", help="Every converted step (the default)."),
    hf_dir: Path = typer.Option(None, "--hf-dir", help="Where the converted global_stepN folders are "
                                                       "(default: <run>/hf, as `opskit ckpt convert` writes)."),
    public: bool = typer.Option(False, "--public", help="Create the repository public (default: private)."),
    json_output: JsonOutput = False,
) -> None:
    """Upload converted steps to the Hub: one commit per step tagged global_stepN (load with
    `from_pretrained(repo, revision="global_stepN")`), already published steps skipped, model card with steps, tokens
    and validation loss. Token from HF_TOKEN or `huggingface-cli login`. JSON: a list of {tag, commit (null:
    already published), files}."""
    from opskit.ckpt.publish import publish_checkpoint

    directory, run = checkpoint_dir_of(run_or_dir)
    out = progress_console(json_output)
    results = publish_checkpoint(directory, run.hf_dir, run.main_log, to, None if all_steps else step, hf_dir, public,
                                 progress=lambda tag: out.print(f"publishing {tag} ..."))
    emit(results, json_output, lambda published: print_lines(
        f"{r.tag}: already published, skipped" if r.commit is None else
        f"{r.tag}: {r.files} file(s), commit {r.commit[:12]}, tagged" for r in published))


@app.command("generate")
@friendly_errors(extra="convert")
def generate(
    model_dir: Path = typer.Argument(..., help="A Hugging Face model folder (e.g. from `opskit ckpt convert`)."),
    prompt: str = typer.Option("And God said", "--prompt"),
    max_new_tokens: int = typer.Option(40, "--max-new-tokens", min=1),
    seed: int = typer.Option(0, "--seed"),
    json_output: JsonOutput = False,
) -> None:
    """Sample a continuation of PROMPT with transformers. JSON: model_dir, prompt, seed and the text."""
    from opskit.ckpt.generate import generate as sample

    text = sample(model_dir, prompt, max_new_tokens, seed)
    emit({"model_dir": str(model_dir), "prompt": prompt, "seed": seed, "text": text}, json_output,
         lambda done: console.print(done["text"]))
