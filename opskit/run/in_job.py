"""``python -m opskit.run.in_job``: the entry of job scripts rendered before :mod:`opskit.allocation.job` (a bash loop
that called it), kept for such a script still queued when opskit is upgraded. The code is
:mod:`opskit.allocation.in_job`; run by name, so that this layer imports nothing above it."""

import runpy

if __name__ == "__main__":
    runpy.run_module("opskit.allocation.in_job", run_name="__main__", alter_sys=True)
