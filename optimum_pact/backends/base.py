"""The backend contract: every frozen-weight product of LoRA training goes through one of these."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

from ..nvfp4 import NVFP4Tensor


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
    """

    name: str

    def prepare(self, weight: NVFP4Tensor) -> Any: ...

    def forward(self, x: torch.Tensor, handle: Any) -> torch.Tensor: ...

    def input_grad(self, dy: torch.Tensor, handle: Any) -> torch.Tensor: ...
