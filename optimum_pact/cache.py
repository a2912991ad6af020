"""The one place that knows where optimum-pact keeps what it builds once.

Everything lives under one root: `$PACT_CACHE` when set, else `~/.cache/optimum_pact`. The default model, the
compiled NVFP4 kernel, the compiled NPU graphs and the benchmarks' data each take a subfolder of it.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir(*parts: str, root: str | os.PathLike | None = None) -> Path:
    """`root` (else `$PACT_CACHE`, else `~/.cache/optimum_pact`) joined with `parts`; nothing is created."""
    if root is None:
        root = os.environ.get("PACT_CACHE") or Path.home() / ".cache" / "optimum_pact"
    return Path(root).expanduser().joinpath(*parts)


__all__ = ["cache_dir"]
