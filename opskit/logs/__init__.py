"""Megatron-style training logs: parse (incrementally), find spikes, estimate the ETA, plot.

Plain library code for ``opskit logs`` and the hourly watchdog: nothing here imports typer, rich, matplotlib or torch
at module level (``plot.py`` and ``tensorboard.py`` import theirs inside functions).

The watchdog's hour, in three calls::

    chunk = read_from(run.main_log, offset)          # only the bytes added since ``offset``; chunk.offset for next time
    history = (history + chunk.records)[-5000:]      # keep enough for the spike window
    spikes = find_spikes(timeline(history))          # robust z-score; remedies(spikes, save_interval) for what to do
    state = progress(timeline(history), planned_tokens=...)   # ETA
"""
