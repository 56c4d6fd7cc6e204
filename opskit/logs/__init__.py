"""Megatron-style training logs: parse (incrementally), find spikes, estimate the ETA, plot.

Plain library code for ``opskit logs`` and the hourly watchdog: nothing here imports typer, rich, matplotlib or torch
at module level (``plot.py`` and ``tensorboard.py`` import theirs inside functions).
"""
