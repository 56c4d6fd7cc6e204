"""``opskit plan NAME``: a spec turned into numbers."""

from __future__ import annotations

import typer
from rich.table import Table

from opskit.cli._common import console, friendly_errors, print_json


@friendly_errors
def plan(
    name: str = typer.Argument(..., help="Spec name, unique prefix or YAML path."),
    json_output: bool = typer.Option(False, "--json", help="Machine-readable output."),
) -> None:
    """Parameters, layout, iterations and memory of a training spec."""
    from opskit.plan import make_plan
    from opskit.spec import load_spec

    spec = load_spec(name)
    result = make_plan(spec)
    if json_output:
        print_json({"name": spec.name, **result.as_dict()})
        return
    table = Table(title=f"plan: {spec.name}", show_header=False)
    table.add_row("parameters", f"{result.parameters:,} ({result.parameters / 1e9:.3f}B)")
    table.add_row("hidden/layers, hidden/heads", f"{result.hidden_per_layer:.0f}, {result.hidden_per_head:.0f}")
    p = spec.parallel
    table.add_row("layout", f"{p.world_size} processes = TP {p.tensor_model_parallel_size} x PP "
                            f"{p.pipeline_model_parallel_size} x DP {result.data_parallel_size}")
    table.add_row("train iterations", f"{result.train_iters:,}")
    table.add_row("tokens", f"{result.tokens:,}")
    table.add_row("model states per GPU (18 B/param / (TP*PP))", f"{result.model_state_gb_per_gpu:.2f} GB")
    console.print(table)
