"""When the torch backend hands a frozen product to the Triton NVFP4 kernels (`triton_kernels.py`).

An NVFP4 weight and activations on CUDA go to the kernels wherever triton is installed (`pip install
"optimum-pact[gpu]"`); `PACT_DISABLE_TRITON=1` sends every product down the plain torch path instead (on CUDA: the
weight dequantized per product, then cuBLAS). CPU tensors go to the kernels only under Triton's interpreter, asked
for twice: `TRITON_INTERPRET=1 PACT_TRITON_INTERPRET=1`. The tests run the kernels that way, without a GPU, through
the very dispatch CUDA tensors take. Nothing here imports triton: the core imports without it.

A run cannot crash in the kernels: the first product of each device and dtype checks them on a small case against
the reference (`self_check`: dequantize, then matmul); a triton that does not import, a compile or launch failure
there or at any later product, or a mismatch, sends every product of the process down the torch path from then on,
with one warning saying why (`triton_product`, `disabled_because`).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import logging
import os
from types import ModuleType

import torch

from ..nvfp4 import NVFP4Tensor, dequantize, quantize
from .base import TRITON_DTYPES as DTYPES

logger = logging.getLogger(__name__)
_state: dict = {"why": None, "checked": set()}  # why the kernels are off for this process; (device, dtype) checked


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
    if not isinstance(handle, NVFP4Tensor) or a.dtype not in DTYPES or _state["why"] is not None:
        return False
    if a.is_cuda:  # the environment is read last: a CPU step runs this 400+ times
        return handle.qdata.is_cuda and not _set("PACT_DISABLE_TRITON") and triton_available()
    on_cpu = a.is_cpu and handle.qdata.is_cpu
    return on_cpu and interpreting() and not _set("PACT_DISABLE_TRITON") and triton_available()


@functools.cache
def kernels() -> ModuleType:
    """`optimum_pact.backends.triton_kernels`, imported on first use (it imports triton)."""
    return importlib.import_module(".triton_kernels", __package__)


def disabled_because() -> str | None:
    """Why the kernels are off for the rest of this process (None: they are not)."""
    return _state["why"]


def _disable(why: str) -> None:
    if _state["why"] is None:
        _state["why"] = why
        logger.warning(
            "the Triton NVFP4 kernels are off for this process (%s); every product runs as dequantize + matmul "
            "(cuBLAS on CUDA) instead, the same effective weights. PACT_DISABLE_TRITON=1 skips the kernels and this "
            "check.",
            why,
        )


def self_check(device: torch.device, dtype: torch.dtype) -> str | None:
    """Run both kernels on a small case on `device` in `dtype` against the reference product; None if they agree
    (within the dtype's rounding: the order of the sums differs), else what went wrong."""
    generator = torch.Generator().manual_seed(0)
    weight = quantize(torch.randn(80, 96, generator=generator) * 0.1).to(device)
    x = torch.randn(5, 96, generator=generator).to(device=device, dtype=dtype)
    dy = torch.randn(5, 80, generator=generator).to(device=device, dtype=dtype)
    w = dequantize(weight.qdata, weight.scale, weight.scale_2, dtype)  # bit-exact with the reference
    try:
        got = {"forward": kernels().forward(x, weight), "input_grad": kernels().input_grad(dy, weight)}
    except Exception as err:  # a compile or launch failure, a broken install: anything from ImportError on
        return f"{type(err).__name__} on {device} in {dtype}: {str(err).splitlines()[0] if str(err) else ''}"
    want = {"forward": (x.float() @ w.float().T).to(dtype), "input_grad": (dy.float() @ w.float()).to(dtype)}
    tolerance = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    for name, value in got.items():
        if value.shape != want[name].shape or not torch.allclose(value.float(), want[name].float(), tolerance, 1e-3):
            error = (value.float() - want[name].float()).abs().max() if value.shape == want[name].shape else "shape"
            return f"the {name} kernel disagrees with the reference on {device} in {dtype} (max error {error})"
    return None


def triton_product(kind: str, a: torch.Tensor, handle: NVFP4Tensor) -> torch.Tensor | None:
    """The kernels' `kind` ("forward" or "input_grad") of `a` and `handle`, or None where they are off or fail
    (then they are off for the rest of the process, said once): the caller runs the torch path."""
    key = (a.device, a.dtype)
    if key not in _state["checked"]:
        _state["checked"].add(key)
        why = self_check(a.device, a.dtype)
        if why is not None:
            _disable(why)
            return None
    try:
        return getattr(kernels(), kind)(a, handle)
    except Exception as err:
        _disable(f"{kind} failed on {tuple(a.shape)} x {tuple(handle.shape)}: {type(err).__name__}: {err}")
        return None
