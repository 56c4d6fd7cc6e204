"""The chain's controls: ``opskit kill-switch NAME on|off``, ``opskit cancel|hold|release NAME`` and
``opskit nodes list|add|clear NAME``."""

from __future__ import annotations

import typer

from opskit.cli._common import JsonOutput, SpecName, console, friendly_errors, print_json

nodes_app = typer.Typer(help="The run's bad-node list, which `opskit submit` excludes (--exclude).",
                        no_args_is_help=True)


@friendly_errors
def kill_switch(
    name: SpecName,
    state: str = typer.Argument(..., help="on: the running task saves and exits, queued tasks exit at start. off."),
) -> None:
    """Turn the run's kill switch on or off (the trainer's --kill-switch-path)."""
    from opskit.run.chain import set_kill_switch
    from opskit.run.paths import RunPaths
    from opskit.spec.load import load_spec

    if state not in ("on", "off"):
        raise typer.BadParameter(f"{state!r}: expected on or off", param_hint="STATE")
    run = RunPaths.of(load_spec(name))
    changed = set_kill_switch(run, state == "on")
    console.print(f"kill switch {run.kill_switch} {'is now' if changed else 'was already'} {state}")
    if state == "on":
        console.print("the running task saves a checkpoint and exits; queued tasks exit at start")


def _control(action: str, name: str) -> list[str]:
    from opskit.run.chain import control
    from opskit.run.paths import RunPaths
    from opskit.spec.load import load_spec

    spec = load_spec(name)
    run = RunPaths.of(spec)
    ids = control(run, spec.job_name, spec.slurm.group, action)
    done = {"cancel": "cancelled", "hold": "held", "release": "released"}[action]
    if ids:
        console.print(f"{done} {spec.job_name}: job(s) {', '.join(ids)}")
    else:
        console.print(f"nothing to {action}: no {'pending ' if action != 'cancel' else ''}job of {spec.job_name} "
                      f"for {run.root}")
    return ids


@friendly_errors
def cancel(
    name: SpecName,
    yes: bool = typer.Option(False, "--yes", help="Do not ask (the running task loses the work since its save)."),
) -> None:
    """scancel every job of the run's chain (its jobs, not others of the same name). To stop with a checkpoint, use
    `opskit kill-switch NAME on` instead."""
    if not yes:
        typer.confirm("Cancel the chain? The running task loses everything since its last checkpoint "
                      "(`opskit kill-switch NAME on` saves first)", abort=True)
    _control("cancel", name)


@friendly_errors
def hold(name: SpecName) -> None:
    """scontrol hold the chain's pending jobs (they keep their queue age)."""
    _control("hold", name)


@friendly_errors
def release(name: SpecName) -> None:
    """scontrol release the chain's held jobs."""
    _control("release", name)


@nodes_app.command("list")
@friendly_errors
def nodes_list(
    name: SpecName,
    json_output: JsonOutput = False,
) -> None:
    """The nodes the next submission excludes, with why."""
    from opskit.run.chain import read_bad_nodes
    from opskit.run.paths import RunPaths
    from opskit.spec.load import load_spec

    bad = read_bad_nodes(RunPaths.of(load_spec(name)))
    if json_output:
        print_json(bad)
        return
    if not bad:
        console.print("no bad nodes")
    for node, why in bad.items():
        console.print(f"{node}\t{why}")


@nodes_app.command("add")
@friendly_errors
def nodes_add(
    name: SpecName,
    nodes: list[str] = typer.Argument(..., help="Node names."),
    why: str = typer.Option("added by hand", "--why", help="Reason kept next to the node."),
) -> None:
    """Put nodes on the bad-node list."""
    from datetime import datetime

    from opskit.run.chain import add_bad_nodes
    from opskit.run.paths import RunPaths
    from opskit.spec.load import load_spec

    stamp = f"{datetime.now():%Y-%m-%d %H:%M:%S}"
    new = add_bad_nodes(RunPaths.of(load_spec(name)), {n: f"{stamp} {why}" for n in nodes})
    console.print(f"added {', '.join(new)}" if new else "already on the list")


@nodes_app.command("clear")
@friendly_errors
def nodes_clear(
    name: SpecName,
    nodes: list[str] = typer.Argument(None, help="Node names (default: all)."),
) -> None:
    """Take nodes off the bad-node list (all of them without names)."""
    from opskit.run.chain import clear_bad_nodes
    from opskit.run.paths import RunPaths
    from opskit.spec.load import load_spec

    gone = clear_bad_nodes(RunPaths.of(load_spec(name)), nodes)
    console.print(f"cleared {', '.join(gone)}" if gone else "nothing to clear")
