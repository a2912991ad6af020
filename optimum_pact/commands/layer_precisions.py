"""Each adapter's 16-bit linears on one shared base: what was trained is what runs, adapter by adapter.

An adapter trained with some linears 16-bit (AQLoRA's protected ones, a precision plan's fp16 ones) runs with exactly
those 16-bit and every other one NVFP4. `PactModelForCausalLM` loads the base as its first adapter wants it. When an
adapter that wants a layer the other way becomes active, `apply` builds that layer's other `FrozenLinear` from the
base's checkpoint as training built it (`FrozenLinear.from_linear` on the weight cast to the model's dtype), puts it
in place and keeps the one it replaced aside for the next switch: a layer two adapters disagree on is held both
ways, and that is what several adapters cost (`extra_bytes`).
"""

from __future__ import annotations

import torch
from torch import nn

from ..dataflow import FrozenLinear
from .model_folder import original_weights


def frozen_linears(model: nn.Module) -> dict[str, tuple[str, FrozenLinear]]:
    """`{linear name: (its module path in model, the FrozenLinear)}`; the name as the base model calls the linear
    (peft's `target_name`: no `base_model.model.` prefix, no `.base_layer` suffix)."""
    out = {}
    for path, module in model.named_modules():
        if isinstance(module, FrozenLinear):
            out[path.removeprefix("base_model.model.").removesuffix(".base_layer")] = (path, module)
    return out


class LayerPrecisions:
    """Which linears each loaded adapter holds 16-bit, and the layers kept aside for switching between them."""

    def __init__(self, base_path: str, model: nn.Module):
        self.base_path = base_path
        self.dtype: torch.dtype = model.dtype  # the dtype the frozen weights were built from
        self.wanted: dict[str, set[str]] = {}  # adapter name -> its 16-bit linears
        self.aside: dict[str, FrozenLinear] = {}  # linear name -> its FrozenLinear in the format not in use

    def add(self, adapter: str, sixteen_bit: list[str]) -> None:
        self.wanted[adapter] = set(sixteen_bit)

    def apply(self, model: nn.Module, adapter: str) -> None:
        """Put each linear of `model` in the format `adapter` was trained with."""
        want = self.wanted.get(adapter, set())
        layers = frozen_linears(model)
        todo = {name: entry for name, entry in layers.items() if entry[1].precision != self._format(name, want)}
        missing = [name for name in todo if name not in self.aside]
        originals = original_weights(self.base_path, missing) if missing else {}
        for name, (path, current) in todo.items():
            other = self.aside.pop(name, None)
            if other is None:
                other = self._build(current, originals.pop(name), self._format(name, want))
            self.aside[name] = current
            model.set_submodule(path, other)

    @staticmethod
    def _format(name: str, want: set[str]) -> str:
        return "fp16" if name in want else "nvfp4"

    def _build(self, like: FrozenLinear, weight: torch.Tensor, precision: str) -> FrozenLinear:
        linear = nn.Linear(like.in_features, like.out_features, bias=False, device="meta")
        linear.weight = nn.Parameter(weight.to(self.dtype), requires_grad=False)
        layer = FrozenLinear.from_linear(linear, backend=like.backend, precision=precision)
        layer.bias = like.bias  # the same frozen bias, shared
        return layer

    def extra_bytes(self) -> int:
        """Bytes held by layers kept aside (the cost of adapters that disagree on a layer's format)."""
        return sum(b.numel() * b.element_size() for layer in self.aside.values() for b in layer.buffers())


__all__ = ["LayerPrecisions", "frozen_linears"]
