"""``opskit plan NAME``: a spec turned into numbers (opskit.spec.plan computes, this prints)."""

from __future__ import annotations

import typer
from rich.markup import escape
from rich.table import Table

from opskit.cli._common import console, emit, err_console, friendly_errors

ROWS_SHOWN = 6
"""Ramp-up rows shown at each end of the table (``--json`` has them all)."""


@friendly_errors
def plan(
    name: str = typer.Argument(..., help="Spec name (NAME or NAME:VARIANT), unique prefix or YAML path."),
    nodes: int = typer.Option(None, "--nodes", min=1, help="Plan this many nodes instead of the spec's."),
    gpus: int = typer.Option(None, "--gpus", min=1, help="GPUs for the time estimate (default: the layout's)."),
    tflops: float = typer.Option(None, "--tflops", min=0.001,
                                 help="Achieved TFLOPs per GPU (default: BigScience's figure for the spec's GPU)."),
    from_run: bool = typer.Option(False, "--from-run", help="Also the save interval from the run's own history: "
                                                            "measured failures, save cost and iteration time."),
    json_output: bool = typer.Option(False, "--json", help="Machine-readable output (keys: docs/plan.md)."),
) -> None:
    """Parameters, memory, layout, batch ramp-up, LR and curriculum schedules, FLOPs and days of a training spec."""
    from opskit.history.measures import save_interval_advice
    from opskit.run.paths import RunPaths
    from opskit.spec.load import load_spec
    from opskit.spec.plan import make_plan

    spec = load_spec(name, overrides={"parallel": {"nodes": nodes}} if nodes else None)
    result = make_plan(spec, tflops=tflops, gpus=gpus)
    advice = save_interval_advice(RunPaths.of(spec), spec.checkpoint.save_interval) if from_run else None
    emit({**result.as_json(), **({"save_interval": advice} if advice else {})}, json_output,
         lambda _: _render(spec, result, advice))


def _render(spec, result, advice) -> None:
    """The tables, then the warnings on stderr."""
    for table in _tables(spec, result) + ([_advice_table(advice)] if advice else []):
        console.print(table)
    for warning in result.warnings + (advice.notes if advice else []):
        err_console.print(f"warning: {warning}")


def _advice_table(advice) -> Table:
    """The save interval from the run's history (:class:`opskit.history.measures.SaveIntervalAdvice`)."""
    table = _table("save interval from the run (Young/Daly: sqrt(2 x save cost x MTBF))")
    table.add_row("run so far", f"{advice.tasks} task(s), {advice.hours_run:.1f} h running, {advice.failures} "
                                f"failure(s)")
    table.add_row("measured", f"MTBF {_or_unknown(advice.mtbf_hours, 'h')}, "
                              f"save {_or_unknown(advice.save_seconds, 's')}"
                              f", iteration {_or_unknown(advice.iteration_seconds, 's')}")
    if advice.optimal_interval is not None:
        table.add_row("best interval", f"{advice.optimal_interval:,} iterations: {advice.lost_at_optimal:.2%} of the "
                                       "wall time lost to saves and redone work")
    if advice.lost_at_spec is not None:
        table.add_row("spec's interval", f"{advice.spec_interval:,} iterations: {advice.lost_at_spec:.2%}")
    return table


def _or_unknown(value: float | None, unit: str) -> str:
    return "unknown" if value is None else f"{value:g} {unit}"


def _table(title: str) -> Table:
    table = Table(title=title, show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    return table


def _num(value: float) -> str:
    """A size for a table cell: one decimal from 10 up, three significant digits below (tiny models)."""
    return f"{value:,.1f}" if abs(value) >= 10 else f"{value:.3g}"


def _nodes(values: list[int]) -> str:
    return ", ".join(str(v) for v in values) if values else "none"


def _tables(spec, result) -> list[Table]:
    pp, m, lay, b, lr, t = result.parameters, result.memory, result.layout, result.batch, result.lr, result.time
    tables = []

    model = _table(f"plan: {escape(spec.name)} - model")
    model.add_row("parameters", f"{pp.total:,} ({pp.total / 1e9:.3f}B), {pp.architecture.upper()} formula, padded "
                                f"vocab {pp.padded_vocab_size:,}")
    model.add_row("README formula", f"{pp.readme_formula:,} -> {pp.readme_formula / 1e9:.0f}B  (l*(12h^2+13h) + V*h + "
                                    f"s*h + 2h, V = {spec.data.vocab_size:,})")
    model.add_row("per layer / embeddings", f"{pp.per_layer:,} / {pp.embedding:,}")
    # int() like the READMEs' sanity check (14336/70 -> 204)
    model.add_row("hidden/layers, hidden/heads", f"{int(pp.hidden_per_layer)}, {int(pp.hidden_per_head)}")
    tables.append(model)

    memory = _table("memory")
    parts = " + ".join(f"{v} {k.replace('_', ' ')}" for k, v in m.bytes_per_parameter.items() if v)
    memory.add_row("bytes per parameter", f"{m.total_bytes_per_parameter} = {parts}")
    rounded = (f" ({m.total_bytes_per_parameter} x {pp.readme_billions}B = {m.replica_gb_readme:,.0f} GB as the "
               "READMEs round it)" if pp.readme_billions else "")
    memory.add_row("model states per replica", f"{_num(m.replica_gb)} GB{rounded}")
    background = (f"; saved in the background: {m.async_save_host_gib_per_node:,.1f} GiB of host RAM per node"
                  if m.async_save_host_gib_per_node is not None else "")
    memory.add_row("checkpoint", f"{_num(m.checkpoint_gb)} GB ({m.checkpoint_bytes:,} bytes) per global_stepN"
                                 f"{background}")
    memory.add_row("optimizer", m.optimizer)
    memory.add_row("sharding", f"{m.sharding} (/{m.sharded_over})")
    stage = m.stages[m.heaviest_stage]
    holds = (" + embeddings" if stage.embedding else "") + (" + LM head" if stage.lm_head else "")
    memory.add_row("heaviest GPU", f"pipeline stage {stage.index}: {stage.layers} layers{holds}, "
                                   f"{stage.parameters_per_gpu / 1e9:.3f}B parameters per GPU, "
                                   f"{stage.in_flight_microbatches} micro-batches in flight")
    unallocated = ("" if stage.gradients_at_peak else
                   f"; gradients {_num(stage.gradient_gib)} GiB of them, not yet allocated at the peak")
    memory.add_row("  model states", f"{_num(m.model_state_gib_per_gpu)} GiB, optimizer states "
                                     f"{_num(m.optimizer_state_gib_per_gpu)} GiB of them{unallocated}")
    for mode, gib in (("full", m.activation_gib_per_gpu_recompute), ("selective", m.activation_gib_per_gpu_selective),
                      ("none", m.activation_gib_per_gpu_no_recompute)):
        notes = [note for note, yes in (("the spec's choice", mode == m.recompute),
                                        ("the least that fits", mode == m.advised_recompute)) if yes]
        label = "no" if mode == "none" else mode
        memory.add_row(f"  activations, {label} recompute", f"{_num(gib)} GiB" + (f"  ({', '.join(notes)})"
                                                                                  if notes else ""))
    if stage.lm_head:
        memory.add_row("  LM head logits and loss", f"{_num(stage.lm_loss_gib)} GiB")
    capacity = f" of {m.gpu_memory_gib:g} GiB" if m.gpu_memory_gib else ""
    verdict = "" if m.fits is None else ("  fits" if m.fits else "  DOES NOT FIT")
    memory.add_row("  total", f"{_num(m.total_gib_per_gpu)} GiB{capacity}{verdict}")
    tables.append(memory)

    layout = _table("layout")
    gpu = f" ({escape(spec.parallel.gpu)})" if spec.parallel.gpu else ""
    layout.add_row("GPUs", f"{lay.world_size} = {lay.nodes} nodes x {lay.gpus_per_node}{gpu}")
    layout.add_row("TP x PP x DP", f"{lay.tensor_parallel} x {lay.pipeline_parallel} x {lay.data_parallel}: "
                                   f"{lay.replicas} replicas of {lay.gpus_per_replica} GPUs "
                                   f"({lay.nodes_per_replica:g} nodes)")
    layout.add_row("micro-batches per iteration", f"{lay.microbatches_per_iteration} (GBS {b.global_batch_size} / "
                                                  f"(MBS {b.micro_batch_size} x DP {lay.data_parallel}))")
    if b.rampup_start is not None:
        layout.add_row("valid nodes, ramp-up", f"{_nodes(lay.valid_nodes_rampup)}  (GBS steps of "
                                               f"{b.rampup_increment}, granularity MBS x DP = {lay.batch_granularity})")
    layout.add_row("valid nodes, GBS " + str(b.global_batch_size), _nodes(lay.valid_nodes_full_batch))
    tables.append(layout)

    ramp = Table(title="batch size schedule", title_justify="left")
    for column in ("GBS", "iterations", "samples", "README's steps"):
        ramp.add_column(column, justify="right")
    if b.rampup_start is not None:
        ramp.caption = (f"--rampup-batch-size {b.rampup_start} {b.rampup_increment} {b.rampup_samples:_}: "
                        f"{b.num_increments} increments of {b.samples_per_increment:,.2f} samples; ramp-up "
                        f"{b.rampup_iterations:,} iterations, {b.rampup_consumed_samples:,} samples")
    rows = b.rows
    shown = rows if len(rows) <= 2 * ROWS_SHOWN + 1 else [*rows[:ROWS_SHOWN], None, *rows[-ROWS_SHOWN:]]
    for row in shown:
        if row is None:
            ramp.add_row("...", "", "", "")
            continue
        ramp.add_row(str(row.global_batch_size), f"{row.iterations:,}", f"{row.samples:,}",
                     "" if row.nominal_iterations is None else f"{row.nominal_iterations:,}")
    tables.append(ramp)

    schedule = _table("schedule")
    schedule.add_row("train samples / iterations", f"{b.train_samples:,} / {b.train_iters:,} (the log's "
                                                   f"'iteration N/ {b.train_iters}')")
    schedule.add_row("tokens", f"{b.tokens:,} ({b.tokens / 1e9:,.1f}B)")
    schedule.add_row("LR", f"{lr.lr:g} -> {lr.min_lr:g}, {lr.decay_style}")
    schedule.add_row("LR warmup", f"{lr.warmup_samples:,} samples = {lr.warmup_iterations:,} iterations")
    if lr.decay_samples is not None:
        schedule.add_row("LR decay", f"{lr.decay_samples:,} samples = {lr.decay_iterations:,} iterations")
    if lr.decay_tokens is not None:
        schedule.add_row("LR decay", f"{lr.decay_tokens:,} tokens = {lr.decay_tokens_iterations:,} iterations")
    tables.append(schedule)

    if (cl := result.curriculum) is not None:
        curriculum = _table("curriculum learning")
        curriculum.add_row("seqlen", f"{cl.min_difficulty} -> {cl.max_difficulty} by {cl.difficulty_step}, "
                                     f"{cl.schedule_type}")
        curriculum.add_row("total_curriculum_step", f"{cl.total_curriculum_step:,} (recommended ~"
                                                    f"{cl.recommended_total_curriculum_step:,.0f} = tokens / GBS / "
                                                    "seq_length / 2)")
        curriculum.add_row("iterations per seqlen step", f"{cl.iterations_per_difficulty_step:.1f}")
        curriculum.add_row("tokens during the curriculum", f"{cl.curriculum_tokens:,}")
        if cl.iterations_to_train_tokens is not None:
            curriculum.add_row("iterations to train_tokens", f"{cl.iterations_to_train_tokens:,}")
        tables.append(curriculum)

    time = _table("throughput and time")
    time.add_row("FLOPs per iteration", f"{t.flops_per_iteration_recompute:.4g} with recompute, "
                                        f"{t.flops_per_iteration_no_recompute:.4g} without (full GBS)")
    if t.tflops is None:
        time.add_row("days", "pass --tflops X (achieved TFLOPs per GPU)")
    else:
        time.add_row("TFLOPs per GPU", f"{t.tflops:g} ({t.tflops_source}) on {t.gpus} GPUs")
        time.add_row("seconds per iteration", f"{t.seconds_per_iteration:.2f} at GBS {b.global_batch_size}")
        time.add_row("days", f"{t.days:.2f}  (tokens x {t.flops_per_token_per_parameter} x params / (GPUs x TFLOPs))")
        if t.days_with_rampup_slowdown is not None and b.rampup_start is not None:
            time.add_row("days with ramp-up slowdown", f"{t.days_with_rampup_slowdown:.2f}  (ramp-up: "
                                                       f"{t.rampup_days:.2f} days, pipeline bubble (m+p-1)/m)")
    tables.append(time)
    return tables
