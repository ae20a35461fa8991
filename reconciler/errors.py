"""Errors of the reconciler."""

from __future__ import annotations

from core.errors import UserError


class ReconcileError(RuntimeError):
    """A live set could not be built, or the run cannot go on safely: nothing is deleted."""


class LeaseBusy(UserError):
    """Another reconciler holds the repository's lease."""


class SweepRefused(UserError):
    """The sweep was asked for a mark that is not a successful one."""
