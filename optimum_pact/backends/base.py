"""The backend contract: every frozen-weight product of LoRA training goes through one of these."""

from __future__ import annotations

from collections import Counter
from typing import Any, Protocol, runtime_checkable

import torch

from ..nvfp4 import NVFP4Tensor

TRITON_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # the activation dtypes the Triton kernels take


class BackendUnavailableError(RuntimeError):
    """A backend's runtime (an optional package, a device, a driver) is missing or cannot start.

    The message says what to install or change.
    """


@runtime_checkable
class Backend(Protocol):
    """Holds each frozen weight once and computes both products from it with ONE dequantizer.

    `prepare` runs once per weight (at load, or after the module moves device); `forward` returns
    `x @ deq(W).T` (also used for recomputation under activation checkpointing) and `input_grad`
    returns `dy @ deq(W)`. Neither may keep a dequantized or transposed copy of `W` between calls.

    A model holds ONE instance (`get_backend`), shared by all its layers: whatever the backend builds once
    (compiled graphs, a started device) lives on that instance.

    Optional: `bind_lora(handle, lora_a, lora_b, scaling)` returns a callable computing `forward(x) + scaling *
    (x @ A.T) @ B.T` in one call for the x it takes (None for the others), or None where the backend has no such
    product. LoRA layers bind it once per adapter at inference (the torch backend's fused decoding product) and
    run the two apart otherwise.
    """

    name: str
    """Which backend this is: "torch" or "qnn"."""
    requested: str
    """The name asked of `get_backend`: "auto", or this backend's own name."""
    reason: str
    """Why this backend runs: "requested" for an explicit name, what `"auto"` found otherwise."""
    counts: Counter[str]
    """Tallies of the work done: products run (`forward`, `input_grad`), and backend-specific events."""
    runs_beside_cpu: bool
    """Whether the products run beside the CPU cores computing the adapter path, so overlapping the two pays."""

    def dense_weight_dtype(self, source_dtype: torch.dtype) -> torch.dtype:
        """The dtype a 16-bit (precision "fp16", unquantized) layer with a `source_dtype` weight is stored in."""
        ...

    def prepare(self, weight: NVFP4Tensor | torch.Tensor) -> Any: ...

    def forward(self, x: torch.Tensor, handle: Any) -> torch.Tensor: ...

    def input_grad(self, dy: torch.Tensor, handle: Any) -> torch.Tensor: ...
