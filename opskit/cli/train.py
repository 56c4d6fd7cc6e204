"""``opskit train ARGS``: the trainer in this process, exactly as ``python -m opskit.train ARGS``."""

from __future__ import annotations

import typer


def train(ctx: typer.Context) -> None:
    """Run the Megatron-DeepSpeed-style trainer (flags as in Megatron-DeepSpeed; --help lists them)."""
    from opskit.train.main import main

    raise typer.Exit(main(list(ctx.args)))
