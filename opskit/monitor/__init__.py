"""Watching a run: the hourly watchdog as read -> check -> act -> report, its findings and alerts, the pulse of a
running job."""
