"""Small file and process helpers shared by the model cache, the checkpoints, the output lock, the offloader and the
readers of user-supplied config files."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path


def sha256_file(path: str | Path) -> str:
    """Hex sha256 of a file, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def pid_alive(pid: int) -> bool:
    """Whether process `pid` exists (on POSIX; elsewhere, where `os.kill` would end it, assume it does)."""
    if os.name != "posix":
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def read_json_object(path: str | Path, fix: str, label: str | None = None) -> dict:
    """The JSON object in config file `path`. A file that cannot be read, is empty, is not JSON or holds something
    else than an object is a ValueError saying which (`label`, default the path, leads it) and ending in `fix`."""
    label = label or str(path)
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"{label} cannot be read ({err}); {fix}") from None
    if not text.strip():
        raise ValueError(f"{label} is empty (an interrupted save, download or copy?); {fix}")
    try:
        data = json.loads(text)
    except ValueError as err:
        raise ValueError(f"{label} is not valid JSON ({err}): it is damaged or cut short; {fix}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{label} does not hold a JSON object (it holds a {type(data).__name__}); {fix}")
    return data
