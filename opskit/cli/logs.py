"""``opskit logs parse|show|tail|plot|spikes``: Megatron-style training logs from the command line."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import typer
from rich.table import Table

from opskit.cli._common import JsonOutput, console, emit, err_console, friendly_errors, print_json_line

app = typer.Typer(help="Training logs (Megatron-style iteration and validation lines).", no_args_is_help=True)

# (record field, column header): short headers keep the table readable in an 80-column pipe.
COLUMNS = (("iteration", "iteration"), ("consumed_tokens", "tokens"), ("lm_loss", "lm loss"),
           ("learning_rate", "lr"), ("grad_norm", "grad norm"), ("elapsed_time_per_iteration_s", "s/it"),
           ("tflops", "TFLOPs"))


def _report_skipped(name: str, skipped: int) -> None:
    err_console.print(f"{name}: {skipped} iteration/validation line(s) skipped (cut, wrapped or garbled)")


def _note(line: str | None) -> None:
    if line:
        err_console.print(line)


@app.command("parse")
@friendly_errors
def parse(
    files: list[Path] = typer.Argument(..., help="Log files."),
    output_format: str = typer.Option("jsonl", "--format", help="jsonl or csv."),
    json_output: bool = typer.Option(False, "--json", help="JSON Lines, one record a line: what --format jsonl (the "
                                                           "default) writes."),
) -> None:
    """One record per iteration and validation line, with its restart segment (0, 1, ... each time the iteration
    goes back; per srun `--label` rank, given as `rank`, when several ranks print iteration lines); unknown
    `key: value |` fields under `extra` (csv: `extra.KEY` columns). A file that gave no records or skipped lines gets
    one line on stderr; one that cannot be read (a folder, missing) an `error:` line, and the others are still parsed
    (exit 1)."""
    from opskit.logs.export import write_files
    from opskit.logs.parse import LogFormatError, read_from

    if output_format not in ("jsonl", "csv"):
        raise LogFormatError(f"--format {output_format}: expected jsonl or csv")
    if json_output and output_format != "jsonl":
        raise LogFormatError(f"--json writes JSON Lines: leave out --format {output_format}")
    chunks, failed = [], False
    for path in files:
        try:
            chunk = read_from(path, columnar=True)
        except (LogFormatError, FileNotFoundError) as e:
            err_console.print(f"error: {e}")
            failed = True
            continue
        _note(chunk.summary(str(path)))
        chunks.append((str(path), chunk))
    write_files(chunks, output_format, sys.stdout)
    if failed:
        raise typer.Exit(1)


@app.command("show")
@friendly_errors
def show(
    name_or_file: str = typer.Argument(..., help="Spec name (its main_log.txt), run folder or log file."),
    last: int = typer.Option(10, "--last", min=1, help="How many iteration lines to show."),
    recent: int = typer.Option(20, "--recent", min=1, help="Iterations whose median time gives the ETA."),
    json_output: bool = typer.Option(False, "--json", help="Records, progress and ETA as JSON."),
) -> None:
    """The last iteration lines (read from the end of the log), progress, ETA and tokens consumed / planned."""
    from opskit.history.sources import log_tail

    emit(log_tail(name_or_file, last, recent), json_output, lambda view: _render_show(view, recent))


def _render_show(view, recent: int) -> None:
    from opskit.logs.eta import progress_lines

    path, records, first, state = view.file, view.records, view.first, view.progress
    if not records:
        console.print(f"{path}: no iteration lines yet")
        return
    table = Table(title=str(path))
    for _, header in COLUMNS:
        table.add_column(header, justify="right")
    for r in records:
        table.add_row(*(f"{r[c]:.4g}" if isinstance(r.get(c), float) else str(r.get(c, "")) for c, _ in COLUMNS))
    console.print(table)
    for line in progress_lines(state, recent):
        console.print(line)
    final = records[-1]
    console.print(f"lm loss: first {_loss(first)} (iteration {first['iteration']}), "
                  f"last {_loss(final)} (iteration {final['iteration']} of {final['train_iters']})")


def _loss(record: dict) -> str:
    """Megatron prints no ``lm loss`` when the interval's average is not positive (all iterations skipped)."""
    return f"{record['lm_loss']:.4f}" if "lm_loss" in record else "none logged"


@app.command("tail")
@friendly_errors
def tail(
    name_or_file: str = typer.Argument(..., help="Spec name, run folder or log file."),
    lines: int = typer.Option(10, "--lines", "-n", min=0, help="How many of the file's last lines to show first."),
    remote: str = typer.Option(None, "--remote", help="Follow the copy published by `opskit sync` to this target "
                                                      "(file:///path, gs://bucket/prefix, hf://[datasets/]org/repo) "
                                                      "instead of the local log, by range reads."),
    interval: float = typer.Option(2.0, "--interval", min=0.05, help="Seconds between polls."),
    json_output: bool = typer.Option(False, "--json", help='JSON Lines: one object per log line, {"line": TEXT}, '
                                                           "flushed as it comes."),
) -> None:
    """Follow a log as `tail -f` does, from its last lines; survives the file being replaced (a sync). With --json,
    JSON Lines (one object per line), not one JSON document."""
    from opskit.history.sources import resolve
    from opskit.logs.follow import follow, follow_published, published_key
    from opskit.targets import open_target

    local = resolve(name_or_file).text_log("tail")
    if remote:
        followed = follow_published(open_target(remote, "--remote"), published_key(local), lines, interval,
                                    sleep=time.sleep)
    else:
        followed = follow(local, lines, interval, sleep=time.sleep)
    try:
        for line in followed:
            if json_output:
                print_json_line({"line": line})
            else:
                sys.stdout.write(line + "\n")
                sys.stdout.flush()
    except KeyboardInterrupt:
        raise typer.Exit(0) from None


@app.command("plot")
@friendly_errors
def plot(
    inputs: list[str] = typer.Argument(..., help="Spec names, run folders, log files or TensorBoard event folders."),
    x: str = typer.Option("iteration", "--x", help="iteration, samples or tokens."),
    y: str = typer.Option("lm_loss", "--y", help="lm_loss, grad_norm, lr, tflops, loss_scale, validation_lm_loss, "
                                                 "elapsed_time_per_iteration_s, ... (record keys)."),
    x_range: str = typer.Option(None, "--range", help="A:B on the x axis (A: or :B open), e.g. 0:24e9."),
    smooth: int = typer.Option(1, "--smooth", min=1, help="Trailing mean over N points."),
    log_y: bool = typer.Option(False, "--log-y", help="Logarithmic y axis."),
    out: Path = typer.Option(None, "--out", help="Image to write: .png, .jpg, .svg or .pdf (the suffix picks the "
                                                 "format); without it, a terminal plot (stdout a terminal)."),
    force: bool = typer.Option(False, "--force", help="Replace an image an earlier `opskit logs plot` wrote (never "
                                                      "a file opskit did not write)."),
    json_output: bool = typer.Option(False, "--json", help="With --out: the image's path, the axes and each run's "
                                                           "series (name, points, x range, last y, spikes) as JSON."),
) -> None:
    """Plot a metric of one or more runs: an image with --out, else a terminal plot. One line per run, spikes marked
    with x; restarts resolved (what a resume re-ran replaces the old lines)."""
    from opskit.history.sources import resolved
    from opskit.logs.parse import LogFormatError
    from opskit.logs.plot import check_x, claim_image, draw_image, draw_text, parse_range, run_series, y_key

    key, bounds = y_key(y), parse_range(x_range)
    check_x(x)
    if out is None and json_output:
        raise LogFormatError("--json needs --out plot.png: a terminal plot is not JSON")
    if out is None and not sys.stdout.isatty():
        raise LogFormatError("stdout is not a terminal: give --out plot.png for a PNG")
    if out is not None:
        claim_image(out, force)  # before reading any log
    series = run_series(resolved(inputs), x, y, bounds, smooth, on_skipped=_report_skipped)
    if out is None:
        sys.stdout.write(draw_text(series, x, key, log_y) + "\n")
        return
    image = draw_image(series, out, x, key, log_y, force=force)
    emit({"image": str(image), "x": x, "y": key, "log_y": log_y, "series": series}, json_output,
         lambda done: console.print(f"wrote {image}"))


@app.command("spikes")
@friendly_errors
def spikes(
    name_or_file: str = typer.Argument(..., help="Spec name, run folder, log file or TensorBoard event folder."),
    save_interval: int = typer.Option(None, "--save-interval", min=1,
                                      help="Checkpoint interval (default: the spec's; with a spec, the existing "
                                           "global_stepN folders come first)."),
    window: int = typer.Option(100, "--window", min=5, help="Previous values the robust z-score is taken over."),
    threshold: float = typer.Option(6.0, "--threshold", min=1.0,
                                    help="Robust z-score above which a value is a spike (>= 1)."),
    json_output: JsonOutput = False,
) -> None:
    """lm-loss and grad-norm spikes: iteration ranges, the checkpoint to roll back to, the
    --skip-train-iteration-range to restart with."""
    from opskit.history.sources import resolve
    from opskit.logs.spikes import remedies, spikes_of
    from opskit.rules.divergence import spike_config

    source, config = resolve(name_or_file), spike_config(window, threshold)
    line = source.timeline(config.metrics)
    found, iterations = spikes_of(line, config), line["iteration"]
    fixes = remedies(found, save_interval or source.save_interval,
                     None if save_interval else source.checkpoints)
    incidents = source.incidents()
    emit({"file": str(source.path), "spikes": found, "remedies": fixes, "incidents": incidents}, json_output,
         lambda _: _render_spikes(source.path, found, fixes, iterations, incidents))


def _render_spikes(path: Path, found: list, fixes: list, iterations, incidents: list[dict]) -> None:
    from opskit.run.incidents import incident_line

    for incident in incidents:  # what the run did about them, itself (opskit.allocation.divergence)
        console.print(incident_line(incident))
    if not found:
        # a line per --log-interval iterations: the lines are what was judged, not every iteration
        console.print(f"{path}: no spikes in {len(iterations):,} iteration line(s) "
                      f"(iterations {iterations[0]}-{iterations[-1]})")
        return
    table = Table(title=str(path))
    for header in ("metric", "first", "last", "peak at", "peak", "baseline", "back to normal at"):
        table.add_column(header, justify="right")
    for s in found:
        table.add_row(s.metric, str(s.first), str(s.last), str(s.peak_iteration), f"{s.peak:.4g}",
                      f"{s.baseline:.4g}", "not yet" if s.recovered_at is None else str(s.recovered_at))
    console.print(table)
    for fix in fixes:
        if fix.checkpoint is None:
            console.print(f"iterations {fix.first}-{fix.end}: no checkpoint before it known (give --save-interval)")
        else:
            console.print(f"iterations {fix.first}-{fix.end}: roll back to {fix.checkpoint} and restart with "
                          f"--skip-train-iteration-range {fix.skip_range}")
