"""User-facing runtime errors: printed as one line by the CLIs (exit 2), never as a traceback."""

from __future__ import annotations


class RunError(RuntimeError):
    """A run that cannot go on for a reason the user can fix (no HF architecture, a bad flag, NaN losses...)."""
