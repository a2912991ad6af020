"""When the torch backend hands a frozen product to the Triton NVFP4 kernels (`triton_kernels.py`).

An NVFP4 weight and activations on CUDA go to the kernels wherever triton is installed (`pip install
"optimum-pact[gpu]"`); `PACT_DISABLE_TRITON=1` sends every product down the plain torch path instead (on CUDA: the
weight dequantized per product, then cuBLAS). CPU tensors go to the kernels only under Triton's interpreter, asked
for twice: `TRITON_INTERPRET=1 PACT_TRITON_INTERPRET=1`. The tests run the kernels that way, without a GPU, through
the very dispatch CUDA tensors take. Nothing here imports triton: the core imports without it.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
from types import ModuleType

import torch

from ..nvfp4 import NVFP4Tensor
from .base import BackendUnavailableError

DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # the activation dtypes the kernels take


def _set(name: str) -> bool:
    return os.environ.get(name, "") not in ("", "0")


@functools.cache
def triton_available() -> bool:
    """Whether triton is installed (not imported: that happens at the first product that needs it)."""
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """Whether CPU tensors go to the kernels: Triton's interpreter on (TRITON_INTERPRET=1) and asked for here too
    (PACT_TRITON_INTERPRET=1); both are read at each product, TRITON_INTERPRET by triton when it first compiles."""
    return _set("TRITON_INTERPRET") and _set("PACT_TRITON_INTERPRET")


def runs_on_triton(a: torch.Tensor, handle: object) -> bool:
    """Whether the product of activations `a` and the prepared weight `handle` runs in the Triton kernels: an NVFP4
    weight, activations in a dtype they take, both on CUDA (or both on the CPU under the interpreter)."""
    if not isinstance(handle, NVFP4Tensor) or a.dtype not in DTYPES:
        return False
    if a.is_cuda:  # the environment is read last: a CPU step runs this 400+ times
        return handle.qdata.is_cuda and not _set("PACT_DISABLE_TRITON") and triton_available()
    on_cpu = a.is_cpu and handle.qdata.is_cpu
    return on_cpu and interpreting() and not _set("PACT_DISABLE_TRITON") and triton_available()


@functools.cache
def kernels() -> ModuleType:
    """`optimum_pact.backends.triton_kernels`, imported on first use; a triton that fails to import is an error
    saying what to do, never a silent fall-back."""
    try:
        return importlib.import_module(".triton_kernels", __package__)
    except Exception as err:  # a broken install raises anything from ImportError to RuntimeError
        raise BackendUnavailableError(
            f"The Triton NVFP4 kernels did not load ({type(err).__name__}: {err}). Install a working triton "
            "(pip install 'optimum-pact[gpu]'), or set PACT_DISABLE_TRITON=1 to run CUDA products through torch."
        ) from err
