"""``opskit``: the command groups, registered on one typer app. Nothing here imports torch or deepspeed."""

from __future__ import annotations

import typer

from opskit import __version__
from opskit.cli import (
    chain,
    ckpt,
    cron,
    data,
    goodput,
    logs,
    plan,
    preflight,
    rehearse,
    report,
    specs,
    status,
    submit,
    sync,
    train,
)

app = typer.Typer(
    name="opskit",
    help="Operations toolkit for months-long LLM pretraining on SLURM: plan, submit, train, watch, sync, convert.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    add_completion=False,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"opskit {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
) -> None:
    """Operations toolkit for months-long LLM pretraining on SLURM."""


app.command("plan")(plan.plan)
app.command("submit")(submit.submit)
app.command("rehearse")(rehearse.rehearse)
app.command("train", context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
            add_help_option=False)(train.train)
app.command("status")(status.status)
app.command("goodput")(goodput.goodput)
app.command("report")(report.report)
app.command("preflight")(preflight.preflight)
app.command("sync")(sync.sync)
app.command("kill-switch")(chain.kill_switch)
app.command("cancel")(chain.cancel)
app.command("hold")(chain.hold)
app.command("release")(chain.release)
app.add_typer(chain.nodes_app, name="nodes")
app.add_typer(cron.app, name="cron")
app.add_typer(ckpt.app, name="ckpt")
app.add_typer(logs.app, name="logs")
app.add_typer(data.app, name="data")
app.add_typer(specs.app, name="specs")


def main() -> None:
    app()


if __name__ == "__main__":  # python -m opskit.cli.app
    main()
