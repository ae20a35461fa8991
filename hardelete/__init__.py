"""hardelete: safe hard deletion of unreferenced data in versioned object storage."""

__version__ = "0.1.0"


class UserError(Exception):
    """A mistake by the person running a command: shown as one line, never a traceback."""
