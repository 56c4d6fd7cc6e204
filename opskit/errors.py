"""The one base of opskit's own errors: the CLI turns any of them into ``error: <one line>`` (no traceback)."""


class OpskitError(Exception):
    """A failure opskit can explain in one line naming the file, field or flag and what was expected."""
