"""Errors a user can act on, shared by the three packages."""

from __future__ import annotations

import errno
from pathlib import Path


class OptionError(ValueError):
    """A bad option value. `option` is the option's name as declared (a dataclass field or keyword argument), so
    a front end that knows how the user spelled it (a CLI flag, a run-file key) can point at it; the message itself
    names the option, the value received and the fix."""

    def __init__(self, option: str, message: str):
        super().__init__(message)
        self.option = option


class NoSpaceError(OSError):
    """Saving `what` into `folder` ran out of disk space (or quota); nothing half-written was left in its place.

    `needed` is about how many bytes the save takes (None: unknown), `free` how many are free there now, `fix` what
    to do, which a front end may reword for its users (`with_fix`).
    """

    def __init__(self, folder: str | Path, what: str, needed: int | None, free: int | None, fix: str):
        self.folder, self.what, self.needed, self.free, self.fix = str(folder), what, needed, free, fix
        super().__init__(errno.ENOSPC, str(self))

    def __str__(self) -> str:
        sizes = [] if self.needed is None else [f"needs about {_mib(self.needed)}"]
        sizes += [] if self.free is None else [f"{_mib(self.free)} free"]
        space = f" ({', '.join(sizes)})" if sizes else ""
        return f"no space left in {self.folder} while saving {self.what}{space}; {self.fix}"

    def with_fix(self, fix: str) -> NoSpaceError:
        """The same error with another `fix` (the one a command's users act on)."""
        return NoSpaceError(self.folder, self.what, self.needed, self.free, fix)


def _mib(size: int) -> str:
    return f"{size / 2**20:.1f} MiB"


__all__ = ["NoSpaceError", "OptionError"]
