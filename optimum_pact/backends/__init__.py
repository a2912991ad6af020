"""Backends compute the frozen-weight products; `get_backend` builds one by name.

A model gets ONE backend instance, built once by `get_backend` and shared by all its layers; what a backend builds
once (the started NPU, its compiled graphs) lives on that instance, never in the process.

Backends that need optional packages (`qnn`: onnxruntime-qnn) import them only when built, so listing them in
`BACKENDS` costs nothing; building one whose packages are missing raises `BackendUnavailableError`.
`backend="auto"` picks `qnn` where a real QNN HTP (a Snapdragon NPU) starts and `torch` otherwise, and logs which
one it chose and why (also kept in the instance's `reason`). On a CUDA machine the torch backend runs CUDA tensors'
NVFP4 products in Triton kernels where triton is installed (`triton_dispatch.py`), and the reason says so.
"""

from __future__ import annotations

import inspect
import logging
import platform

import torch

from . import triton_dispatch
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


def _options_of(cls) -> tuple[str, ...]:
    return tuple(inspect.signature(cls).parameters)


def _build_auto(options: dict) -> tuple[Backend, str]:
    """The backend "auto" stands for on this machine, built with the options it takes, and why it was chosen."""
    from .qnn import is_qnn_available

    if not is_qnn_available():
        reason = "onnxruntime-qnn is not installed"
    elif (machine := platform.machine().lower()) not in NPU_MACHINES:
        reason = f"the QNN HTP on {machine} is an emulator, slower than the CPU"
    else:
        cls = _backend_class("qnn")
        try:
            backend = cls(**{k: v for k, v in options.items() if k in _options_of(cls)})
        except (BackendUnavailableError, ValueError) as err:
            reason = f"the QNN HTP backend did not start ({err})"
            logger.warning("backend='auto': %s; falling back to 'torch'.", reason)
        else:
            return backend, "the QNN HTP backend started"
    cls = _backend_class("torch")
    return cls(**{k: v for k, v in options.items() if k in _options_of(cls)}), _cuda_reason() or reason


def _cuda_reason() -> str | None:
    """Why the torch backend runs on a CUDA machine, with or without the Triton kernels; None without CUDA."""
    if not torch.cuda.is_available():
        return None
    if triton_dispatch.triton_available():
        return "CUDA: torch backend with the Triton NVFP4 kernels"
    return (
        "CUDA without triton: torch backend, each NVFP4 weight dequantized per product "
        "(pip install 'optimum-pact[gpu]' for the Triton kernels)"
    )


def get_backend(name: str, **options) -> Backend:
    """Build ONE backend called `name` (one of `BACKENDS`, or "auto") with its options; build it once per model.

    Options are the backend's keyword arguments (torch: `tile_size`; qnn: `soc_model`, `min_tokens`, ...). An
    option the named backend does not take is a ValueError; with "auto", options the chosen backend does not take
    are dropped. The instance's `requested` is `name` and its `reason` says why it runs ("requested" for an
    explicit name).
    """
    if name == "auto":
        backend, reason = _build_auto(options)
        logger.info("backend='auto' chose %r: %s.", backend.name, reason)
    else:
        cls = _backend_class(name)
        unknown = [k for k in options if k not in _options_of(cls)]
        if unknown:
            elsewhere = [
                f"{k} is an option of backend={other!r}"
                for k in unknown
                for other in BACKENDS
                if other != name and k in _options_of(_backend_class(other))
            ]
            fix = "Drop it" if len(unknown) == 1 else "Drop them"
            fix += f" ({'; '.join(elsewhere)})" if elsewhere else ""
            raise ValueError(
                f"backend={name!r} has no option {', '.join(f'{k}={options[k]!r}' for k in unknown)}; "
                f"its options are {', '.join(_options_of(cls))}. {fix}."
            )
        backend, reason = cls(**options), "requested"
    backend.requested, backend.reason = name, reason
    return backend


__all__ = ["BACKENDS", "BACKEND_CHOICES", "Backend", "BackendUnavailableError", "get_backend"]
