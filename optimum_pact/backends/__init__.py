"""Backends compute the frozen-weight products; `get_backend` builds one by name."""

from __future__ import annotations

from .base import Backend

BACKENDS = ("torch",)


def get_backend(name: str, **options) -> Backend:
    """Build the backend called `name` (one of `BACKENDS`) with its options (for example `tile_size`)."""
    if name == "torch":
        from .torch_backend import TorchBackend

        return TorchBackend(**options)
    raise ValueError(f"Unknown backend {name!r}; choose one of {', '.join(map(repr, BACKENDS))}.")


__all__ = ["BACKENDS", "Backend", "get_backend"]
