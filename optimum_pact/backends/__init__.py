"""Backends compute the frozen-weight products; `get_backend` builds one by name.

Backends that need optional packages (`qnn`: onnxruntime-qnn) import them only when built, so listing them in
`BACKENDS` costs nothing; building one whose packages are missing raises `BackendUnavailableError`.
"""

from __future__ import annotations

from .base import Backend, BackendUnavailableError

BACKENDS = ("torch", "qnn")


def get_backend(name: str, **options) -> Backend:
    """Build the backend called `name` (one of `BACKENDS`) with its options (for example `tile_size`)."""
    if name == "torch":
        from .torch_backend import TorchBackend

        return TorchBackend(**options)
    if name == "qnn":
        from .qnn import QnnBackend

        return QnnBackend(**options)
    raise ValueError(f"Unknown backend {name!r}; choose one of {', '.join(map(repr, BACKENDS))}.")


__all__ = ["BACKENDS", "Backend", "BackendUnavailableError", "get_backend"]
