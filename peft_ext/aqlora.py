"""AQLoRA inside `get_peft_model`: protection by reconstruction error and the speed setting, from PactConfig alone.

Both need the whole set of targeted linears (a ranking; the block count), but peft dispatches one layer at a time.
So with `protect_fraction > 0` or `adapt="speed"`, `dispatch_pact` wraps each targeted `nn.Linear` as it is and
registers it here; when peft has injected every layer it activates the adapter on all of them
(`PactLoraLinear.set_adapter`), and the first such call finalizes the group:

1. take `PactConfig.protected_modules` (as saved, or as `PactConfig.with_calibration` ranked them by sensitivity), or
   else rank the registered linears by reconstruction error (`rank_by` "nvfp4" or "nf4"; "auto" without a
   calibration batch is "nvfp4") and keep the worst `protect_fraction` 16-bit (`FrozenLinear(precision="fp16")`:
   no dequantization);
2. quantize every other one to NVFP4 (`FrozenLinear`), honouring a precision plan;
3. speed setting: delete the adapters below the top `adapt_top_blocks` blocks (their linears stay NVFP4) and, at
   the model's first forward, cut the backward pass below the lowest adapted block (`stop_backward_below`, which
   also defeats the input-embedding `requires_grad` hooks that gradient checkpointing adds).

The chosen list is written back to `PactConfig.protected_modules` (saved in pact_config.json, reused on reload).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from optimum_pact.dataflow import FrozenLinear
from optimum_pact.nvfp4 import BLOCK_SIZE

from .backward_stop import stop_backward_below
from .blocks import block_index, default_top_blocks
from .ranking import choose_protected, error_format, reconstruction_error

logger = logging.getLogger(__name__)


def needs_whole_model(config) -> bool:
    """AQLoRA is on: a fraction to protect, a list of protected linears (kept 16-bit as given, whatever
    protect_fraction says), or the speed setting."""
    return (
        bool(getattr(config, "protect_fraction", 0.0))
        or bool(getattr(config, "protected_modules", None))
        or getattr(config, "adapt", "quality") == "speed"
    )


class PendingLayers:
    """The targeted linears of one `get_peft_model` call, waiting for the whole-model view."""

    def __init__(self, config, adapter_name: str):
        self.config, self.adapter_name = config, adapter_name
        self.layers: dict[str, nn.Module] = {}  # peft target_name -> PactLoraLinear over its nn.Linear
        self.done = False

    def add(self, name: str, layer: nn.Module) -> None:
        self.layers[name] = layer
        layer.pact_pending = self

    def finalize(self) -> None:
        if self.done:
            return
        self.done = True
        config = self.config
        protected = self._protected()
        adapted = self._speed_blocks()
        cutoff = None if adapted is None else adapted.start
        backend = config.get_backend()
        plan = config.precision_plan or {}
        for name, layer in self.layers.items():
            linear = layer.get_base_layer()
            if linear.in_features % BLOCK_SIZE == 0:
                precision = "fp16" if name in protected else plan.get(name, "nvfp4")
                layer.base_layer = FrozenLinear.from_linear(linear, backend=backend, precision=precision)
            if cutoff is not None and (block_index(name) is None or block_index(name) < cutoff):
                layer.delete_adapter(self.adapter_name)
            layer.pact_pending = None
        config.protected_modules = protected
        if adapted is not None:
            pattern = _blocks_pattern(next(name for name in self.layers if block_index(name) is not None))
            config.__dict__["_pact_speed_blocks"] = (pattern, list(adapted))
            lowest = next(iter(self.layers.values()))
            _stop_backward_at_first_forward(lowest, cutoff)
        logger.info(
            "AQLoRA: %d of %d linears kept 16-bit (ranked by %s)%s.",
            len(protected),
            len(self.layers),
            config.rank_by,
            "" if cutoff is None else f"; adapters on blocks {cutoff} and above",
        )
        config.__dict__.get("_pact_pending", {}).pop(self.adapter_name, None)  # a deepcopy must not copy layers
        self.layers = {}

    def _protected(self) -> list[str]:
        config = self.config
        if config.protected_modules is not None:
            unknown = sorted(set(config.protected_modules) - set(self.layers))
            if unknown:
                raise ValueError(
                    f"PactConfig.protected_modules names modules that are not targeted linears: {unknown[:5]}. "
                    "Use the list saved with this model's adapter, or protected_modules=None to rank again."
                )
            return list(config.protected_modules)
        if config.rank_by == "sensitivity":
            raise ValueError(
                "PactConfig(rank_by='sensitivity') ranks layers on a calibration batch, and get_peft_model has none: "
                "call `config = config.with_calibration(model, batch)` first (PactTrainer and `pact finetune` do it "
                "with the first training batch), or choose rank_by='nvfp4' (the weights alone)."
            )
        ranking = [
            (name, reconstruction_error(layer.get_base_layer().weight, error_format(config.rank_by)))
            for name, layer in self.layers.items()
            if layer.get_base_layer().in_features % BLOCK_SIZE == 0
        ]
        return choose_protected(ranking, config.protect_fraction)

    def _speed_blocks(self) -> range | None:
        """adapt='speed': the indices of the adapted (top) blocks; None for adapt='quality'."""
        config = self.config
        if config.adapt != "speed":
            return None
        blocks = [block_index(name) for name in self.layers if block_index(name) is not None]
        if not blocks:
            raise ValueError("PactConfig(adapt='speed') found no targeted linear inside numbered decoder blocks.")
        n = max(blocks) + 1
        top = default_top_blocks(n) if config.adapt_top_blocks is None else config.adapt_top_blocks
        if top > n:
            raise ValueError(
                f"PactConfig.adapt_top_blocks={top} is larger than the model's {n} decoder blocks; "
                f"use a number from 1 to {n} (or None for the default, {default_top_blocks(n)})."
            )
        return range(n - top, n)


def _blocks_pattern(name: str) -> str:
    """The block list's name in a module name (`model.layers.3.mlp.up_proj` -> `layers`): peft's layers_pattern."""
    parts = name.split(".")
    return parts[next(i for i, part in enumerate(parts) if part.isdigit()) - 1]


def _stop_backward_at_first_forward(layer: nn.Module, cutoff: int) -> None:
    """Install `stop_backward_below(model, cutoff)` on the model holding `layer`, at that model's first forward.

    peft gives a dispatcher no handle on the model, so a one-shot global forward pre-hook waits for the first call
    of a model (a module with `get_input_embeddings`) containing `layer`, installs the cut there and removes itself.
    """
    handle = None

    def find_model(module, args):
        if not hasattr(module, "get_input_embeddings") or not any(m is layer for m in module.modules()):
            return
        handle.remove()
        if cutoff > 0:
            stop_backward_below(module, cutoff)

    handle = torch.nn.modules.module.register_module_forward_pre_hook(find_model)
