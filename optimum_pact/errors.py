"""Errors a user can act on, shared by the three packages."""

from __future__ import annotations


class OptionError(ValueError):
    """A bad option value. `option` is the option's name as declared (a dataclass field or keyword argument), so
    a front end that knows how the user spelled it (a CLI flag, a run-file key) can point at it; the message itself
    names the option, the value received and the fix."""

    def __init__(self, option: str, message: str):
        super().__init__(message)
        self.option = option


__all__ = ["OptionError"]
