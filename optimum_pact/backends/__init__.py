"""Backends compute the frozen-weight products; `get_backend` builds one by name.

Backends that need optional packages (`qnn`: onnxruntime-qnn) import them only when built, so listing them in
`BACKENDS` costs nothing; building one whose packages are missing raises `BackendUnavailableError`.
`backend="auto"` picks `qnn` where a real QNN HTP (a Snapdragon NPU) starts and `torch` otherwise, and logs which
one it chose and why.
"""

from __future__ import annotations

import functools
import inspect
import logging
import platform

from .base import Backend, BackendUnavailableError

logger = logging.getLogger(__name__)

BACKENDS = ("torch", "qnn")
BACKEND_CHOICES = (*BACKENDS, "auto")
NPU_MACHINES = ("aarch64", "arm64")  # where the QNN HTP is real hardware; on x86_64 it is an emulator


def _backend_class(name: str):
    if name == "torch":
        from .torch_backend import TorchBackend

        return TorchBackend
    if name == "qnn":
        from .qnn import QnnBackend

        return QnnBackend
    raise ValueError(f"Unknown backend {name!r}; choose one of {', '.join(map(repr, BACKEND_CHOICES))}.")


@functools.cache
def resolve_auto() -> tuple[str, str]:
    """The backend `"auto"` stands for on this machine, and why: (name, reason). Decided once per process."""
    from .qnn import is_qnn_available

    if not is_qnn_available():
        return "torch", "onnxruntime-qnn is not installed"
    machine = platform.machine().lower()
    if machine not in NPU_MACHINES:
        return "torch", f"the QNN HTP on {machine} is an emulator, slower than the CPU"
    try:
        _backend_class("qnn")()
    except (BackendUnavailableError, ValueError) as err:
        return "torch", f"the QNN HTP backend did not start ({err})"
    return "qnn", "the QNN HTP backend started"


def get_backend(name: str, **options) -> Backend:
    """Build the backend called `name` (one of `BACKENDS`, or "auto") with its options.

    Options are the backend's keyword arguments (torch: `tile_size`; qnn: `soc_model`, `min_tokens`, ...). With
    "auto", options the chosen backend does not take are dropped (a `tile_size` of None counts as absent).
    """
    if name == "auto":
        name, reason = resolve_auto()
        logger.info("backend='auto' chose %r: %s.", name, reason)
        accepted = inspect.signature(_backend_class(name)).parameters
        options = {k: v for k, v in options.items() if k in accepted and not (k == "tile_size" and v is None)}
    cls = _backend_class(name)
    unknown = sorted(set(options) - set(inspect.signature(cls).parameters))
    if unknown:
        raise ValueError(
            f"backend={name!r} has no option {', '.join(map(repr, unknown))}; "
            f"its options are {', '.join(inspect.signature(cls).parameters)}."
        )
    return cls(**options)


__all__ = ["BACKENDS", "BACKEND_CHOICES", "Backend", "BackendUnavailableError", "get_backend", "resolve_auto"]
