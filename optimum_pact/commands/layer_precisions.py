"""Each adapter's 16-bit linears on one shared base: what was trained is what runs, adapter by adapter.

An adapter trained with some linears 16-bit (AQLoRA's protected ones, a precision plan's fp16 ones) runs with exactly
those 16-bit and every other one NVFP4. `PactModelForCausalLM` loads the base as its first adapter wants it. When an
adapter that wants a layer the other way becomes active, `apply` builds that layer's other `FrozenLinear` from the
base's checkpoint as training built it (`FrozenLinear.from_linear` on the weight cast to the model's dtype), puts it
in place and keeps the one it replaced aside for the next switch: a layer two adapters disagree on is held both
ways, and that is what several adapters cost (`extra_bytes`).

An adapter trained on its own GPTQ-rounded base (`rounded_base`: `pact_base.safetensors` in its folder) gets those
codes in its NVFP4 linears while it is active; an adapter trained on the shared base gets the nearest rounding of
the checkpoint back. Each set of codes read is kept for the next switch: several people's own bases cost a base each.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from ..dataflow import FrozenLinear
from ..nvfp4 import NVFP4Tensor, quantize
from .model_folder import original_weights
from .rounded_base import apply_codes, frozen_linears, read_codes


class LayerPrecisions:
    """Which linears each loaded adapter holds 16-bit, and the layers kept aside for switching between them."""

    def __init__(self, base_path: str, model: nn.Module, codes: Path | None = None):
        self.base_path = base_path
        self.dtype: torch.dtype = model.dtype  # the dtype the frozen weights were built from
        self.wanted: dict[str, set[str]] = {}  # adapter name -> its 16-bit linears
        self.aside: dict[str, FrozenLinear] = {}  # linear name -> its FrozenLinear in the format not in use
        self.codes_of: dict[str, Path | None] = {}  # adapter name -> its base's codes file (None: nearest rounding)
        self.holding = codes  # the codes the NVFP4 linears hold now
        self.codes: dict[Path | None, dict[str, NVFP4Tensor]] = {}  # codes read (or rounded) so far, by file

    def add(self, adapter: str, sixteen_bit: list[str], codes: Path | None = None) -> None:
        self.wanted[adapter] = set(sixteen_bit)
        self.codes_of[adapter] = codes

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
        codes = self.codes_of.get(adapter)
        if codes != self.holding or (todo and codes is not None):  # another base, or layers built nearest above
            self._load_codes(model, codes)

    def _load_codes(self, model: nn.Module, codes: Path | None) -> None:
        """Put the base codes `codes` (None: the checkpoint's nearest rounding) in every NVFP4 linear of `model`."""
        layers = {name: layer for name, (_, layer) in frozen_linears(model).items() if layer.precision == "nvfp4"}
        if self.holding not in self.codes:  # what the layers hold now, kept for a switch back
            self.codes[self.holding] = {name: layer.nvfp4 for name, layer in layers.items()}
        if codes not in self.codes:  # read once: a switch back finds them here
            self.codes[codes] = {} if codes is None else read_codes(codes)
        held = self.codes[codes]
        missing = [name for name in layers if name not in held]
        if missing and codes is None:  # the shared base: rounded from the checkpoint as training rounds it
            originals = original_weights(self.base_path, missing)
            held.update({name: quantize(originals[name].to(self.dtype)) for name in missing})
        apply_codes(model, held)
        self.holding = codes

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
        aside = sum(b.numel() * b.element_size() for layer in self.aside.values() for b in layer.buffers())
        others = [held for key, held in self.codes.items() if key != self.holding]
        return aside + sum(q.nbytes for held in others for q in held.values())


__all__ = ["LayerPrecisions"]
