"""Watching a run: the hourly watchdog, its findings and alerts, the pulse of a running job, cron, and sync."""
