"""``opskit preflight NAME --nodes LIST [--margin F] [--exclude] [--json]``: check nodes before training trusts them
(opskit.allocation.preflight)."""

from __future__ import annotations

import typer

from opskit.cli._common import JsonOutput, SpecName, console, emit, friendly_errors


@friendly_errors
def preflight(
    name: SpecName,
    nodes: str = typer.Option(..., "--nodes", help="SLURM node list to check, e.g. node[1-3]."),
    margin: float = typer.Option(None, "--margin", min=0.0, max=1.0,
                                 help="Exclude a node whose GEMM is below the median by more than this fraction "
                                      "(default: the spec's slurm.preflight_margin)."),
    exclude: bool = typer.Option(False, "--exclude", help="Put failing nodes on the run's bad-node list."),
    json_output: JsonOutput = False,
) -> None:
    """Run one check per node (srun, a task per node): devices, a timed GEMM, free disk at the checkpoints, GPU Xid
    lines, an all-reduce over the nodes; name the nodes to keep out. Exit 0 when every node passes, 1 otherwise."""
    from opskit.allocation.preflight import run_preflight
    from opskit.spec.load import load_spec

    spec = load_spec(name)
    result = run_preflight(spec, nodes, spec.slurm.preflight_margin if margin is None else margin, exclude)
    emit(result, json_output, lambda checked: _render(checked, exclude))
    if result.excluded:
        raise typer.Exit(1)


def _render(result, exclude: bool) -> None:
    for node in result.nodes:
        figures = (f"GEMM {node.gemm_tflops:.3g} TFLOP/s" if node.gemm_tflops is not None else "no result") + (
            f", {node.free_gb:.0f} GB free" if node.free_gb is not None else "") + (
            f", all-reduce {node.allreduce_s:.2f} s" if node.allreduce_s is not None else "")
        verdict = "EXCLUDE: " + "; ".join(node.problems) if node.problems else "ok"
        console.print(f"{node.node}: {verdict} ({figures})")
    for note in result.notes:
        console.print(f"note: {note}")
    if exclude and result.excluded:
        console.print(f"put {', '.join(n.node for n in result.excluded)} on the bad-node list: the next "
                      "`opskit submit` excludes them")
