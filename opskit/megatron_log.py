"""Kept for existing imports: the parser lives in :mod:`opskit.logs.parse`."""

from opskit.logs.parse import parse_iteration_line, read_iterations

__all__ = ["parse_iteration_line", "read_iterations"]
