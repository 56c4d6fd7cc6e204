"""The chain's controls: ``opskit kill-switch NAME on|off``, ``opskit cancel|hold|release NAME`` and
``opskit nodes list|add|clear NAME``."""

from __future__ import annotations

import typer

from opskit.cli._common import JsonOutput, SpecName, console, emit, friendly_errors
from opskit.errors import OpskitError

nodes_app = typer.Typer(help="The run's bad-node list, which `opskit submit` excludes (--exclude).",
                        no_args_is_help=True)


@friendly_errors
def kill_switch(
    name: SpecName,
    state: str = typer.Argument(..., help="on: the running task saves and exits, queued tasks exit at start. off."),
    json_output: JsonOutput = False,
) -> None:
    """Turn the run's kill switch on or off (the trainer's --kill-switch-path)."""
    from opskit.run.chain import set_kill_switch
    from opskit.run.paths import RunPaths
    from opskit.spec.load import load_spec

    if state not in ("on", "off"):
        raise typer.BadParameter(f"{state!r}: expected on or off", param_hint="STATE")
    run = RunPaths.of(load_spec(name))
    changed = set_kill_switch(run, state == "on")
    emit({"kill_switch": str(run.kill_switch), "state": state, "changed": changed}, json_output, _render_kill_switch)


def _render_kill_switch(done: dict) -> None:
    console.print(f"kill switch {done['kill_switch']} {'is now' if done['changed'] else 'was already'} "
                  f"{done['state']}")
    if done["state"] == "on":
        console.print("the running task saves a checkpoint and exits; queued tasks exit at start")


def _control(action: str, name: str, json_output: bool) -> None:
    """cancel, hold or release the chain's jobs; JSON: ``{"action", "job_name", "run", "job_ids"}``."""
    from opskit.run.chain import control
    from opskit.run.paths import RunPaths
    from opskit.spec.load import load_spec

    spec = load_spec(name)
    run = RunPaths.of(spec)
    ids = control(run, spec.job_name, spec.slurm.group, action)
    emit({"action": action, "job_name": spec.job_name, "run": str(run.root), "job_ids": ids}, json_output,
         _render_control)


def _render_control(done: dict) -> None:
    action, job_name, ids = done["action"], done["job_name"], done["job_ids"]
    if ids:
        verb = {"cancel": "cancelled", "hold": "held", "release": "released"}[action]
        console.print(f"{verb} {job_name}: job(s) {', '.join(ids)}")
    else:
        console.print(f"nothing to {action}: no {'pending ' if action != 'cancel' else ''}job of {job_name} "
                      f"for {done['run']}")


@friendly_errors
def cancel(
    name: SpecName,
    yes: bool = typer.Option(False, "--yes", help="Do not ask (the running task loses the work since its save); "
                                                  "required with --json."),
    json_output: JsonOutput = False,
) -> None:
    """scancel every job of the run's chain (its jobs, not others of the same name). To stop with a checkpoint, use
    `opskit kill-switch NAME on` instead."""
    if not yes and json_output:  # a script reads the JSON: it is asked nothing
        raise OpskitError("cancel --json asks nothing: add --yes to cancel the chain")
    if not yes:
        typer.confirm("Cancel the chain? The running task loses everything since its last checkpoint "
                      "(`opskit kill-switch NAME on` saves first)", abort=True)
    _control("cancel", name, json_output)


@friendly_errors
def hold(name: SpecName, json_output: JsonOutput = False) -> None:
    """scontrol hold the chain's pending jobs (they keep their queue age)."""
    _control("hold", name, json_output)


@friendly_errors
def release(name: SpecName, json_output: JsonOutput = False) -> None:
    """scontrol release the chain's held jobs."""
    _control("release", name, json_output)


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

    emit(read_bad_nodes(RunPaths.of(load_spec(name))), json_output, _render_bad_nodes)  # JSON: {node: why}


def _render_bad_nodes(bad: dict[str, str]) -> None:
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
    json_output: JsonOutput = False,
) -> None:
    """Put nodes on the bad-node list."""
    from datetime import datetime

    from opskit.run.chain import add_bad_nodes
    from opskit.run.paths import RunPaths
    from opskit.spec.load import load_spec

    stamp = f"{datetime.now():%Y-%m-%d %H:%M:%S}"
    new = add_bad_nodes(RunPaths.of(load_spec(name)), {n: f"{stamp} {why}" for n in nodes})
    emit({"added": new}, json_output,
         lambda done: console.print(f"added {', '.join(done['added'])}" if done["added"] else "already on the list"))


@nodes_app.command("clear")
@friendly_errors
def nodes_clear(
    name: SpecName,
    nodes: list[str] = typer.Argument(None, help="Node names (default: all)."),
    json_output: JsonOutput = False,
) -> None:
    """Take nodes off the bad-node list (all of them without names)."""
    from opskit.run.chain import clear_bad_nodes
    from opskit.run.paths import RunPaths
    from opskit.spec.load import load_spec

    gone = clear_bad_nodes(RunPaths.of(load_spec(name)), nodes)
    emit({"cleared": gone}, json_output,
         lambda done: console.print(f"cleared {', '.join(done['cleared'])}" if done["cleared"] else "nothing to clear"))
