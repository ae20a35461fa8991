"""Errors every command shares."""


class UserError(Exception):
    """A mistake by the person running a command: shown as one line, never a traceback."""
