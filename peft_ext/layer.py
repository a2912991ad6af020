"""LoRA on top of a FrozenLinear, and the dispatch that puts it on every targeted linear."""

from __future__ import annotations

import logging

import torch
from peft.tuners.lora import Linear as LoraLinear
from peft.tuners.tuners_utils import BaseTunerLayer
from torch import nn

from optimum_pact.dataflow import FrozenLinear
from optimum_pact.dataflow.overlap import LoraFrozenProduct

from .aqlora import PendingLayers, needs_whole_model
from .fused import FusedAdapter

logger = logging.getLogger(__name__)


class PactLoraLinear(LoraLinear):
    """peft's `lora.Linear` whose base layer is a `FrozenLinear`.

    The base product (and its input gradient) runs on the PACT backend from the packed NVFP4 weight; the adapter
    path `lora_B(lora_A(dropout(x))) * scaling` is peft's, so adapter weights, names and files are plain LoRA.
    A single active vanilla adapter without dropout runs through `LoraFrozenProduct`: peft's products and roundings
    in one autograd node, and with `PactConfig.overlap` (default: on for backends other than torch) the adapter path
    on the CPU while the backend computes the frozen product, forward and backward. Anything else (several adapters,
    dropout while training, DoRA and other variants, peft's per-call arguments, hooks on the base layer) takes peft's
    own forward.
    """

    def __init__(self, base_layer, adapter_name: str, config, **kwargs):
        self.pact_pending = None  # an AQLoRA group this layer waits in (peft_ext.aqlora), until it is finalized
        self._pact_fused = None  # the bound inference product (FusedAdapter), built on first use
        self._pact_base_dtype = getattr(config, "base_dtype", None)  # what the frozen weights were built from
        super().__init__(base_layer, adapter_name, config=config, **kwargs)
        self._pact_overlap_option = getattr(config, "overlap", None)

    @property
    def pact_overlap(self) -> bool:
        """Whether the overlapped path runs: `PactConfig.overlap`, by default on for backends other than torch."""
        if self._pact_overlap_option is not None:
            return self._pact_overlap_option
        backend = getattr(self.get_base_layer(), "backend", None)  # the CPU would compete with itself on torch
        return backend is not None and backend.runs_beside_cpu

    def set_adapter(self, adapter_names, inference_mode: bool = False) -> None:
        super().set_adapter(adapter_names, inference_mode=inference_mode)
        if self.pact_pending is not None:  # peft activates adapters once every layer is injected: finalize AQLoRA
            self.pact_pending.finalize()

    def update_layer(self, adapter_name, *args, **kwargs):
        self._pact_fused = None
        return super().update_layer(adapter_name, *args, **kwargs)

    def _get_base_layer_device_and_dtype(self, base_layer):
        """peft casts a new adapter to its base layer's dtype (then back to float32): for a FrozenLinear that is the
        dtype of the weights it was built from (`PactConfig.base_dtype`), as on that nn.Linear, so the adapter
        starts from the same values whether the base was quantized before or after peft wrapped it."""
        device, dtype = super()._get_base_layer_device_and_dtype(base_layer)
        if isinstance(base_layer, FrozenLinear) and self._pact_base_dtype is not None:
            dtype = getattr(torch, self._pact_base_dtype)
        return device, dtype

    def delete_adapter(self, adapter_name: str) -> None:
        self._pact_fused = None
        super().delete_adapter(adapter_name)

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if not args and not kwargs and not torch.is_grad_enabled():
            y = self._fused_forward(x)
            if y is not None:
                return y
        adapter = self._plain_adapter(args, kwargs)
        if adapter is None:
            return super().forward(x, *args, **kwargs)
        base = self.get_base_layer()
        lora_a, lora_b = self.lora_A[adapter].weight, self.lora_B[adapter].weight
        scaling, overlap = self.scaling[adapter], self.pact_overlap
        return LoraFrozenProduct.apply(
            x, lora_a, lora_b, scaling, base.backend, base.handle, base.bias, base.stream, overlap
        )

    def _fused_forward(self, x: torch.Tensor) -> torch.Tensor | None:
        """Inference: the frozen product and the adapter's term in one backend call where the backend fuses them
        (the torch backend when decoding); None otherwise. Bound once (`FusedAdapter`), rebuilt when stale."""
        fused = self._pact_fused
        if fused is None or not fused.current(self):
            fused = self._pact_fused = FusedAdapter(self)
        return fused(x)

    def _plain_adapter(self, args, kwargs) -> str | None:
        """The one active vanilla-LoRA adapter the overlapped and fused paths can run, or None (peft's own path)."""
        if args or kwargs or self.disable_adapters or self.merged:
            return None
        base = self.get_base_layer()
        if not isinstance(base, FrozenLinear) or base._forward_hooks or base._forward_pre_hooks:
            return None  # hooks on the base layer see its calls on peft's path, which calls it
        active = [a for a in self.active_adapters if a in self.lora_A]
        if len(active) != 1:
            return None
        (adapter,) = active
        dropout = self.lora_dropout[adapter]
        if adapter in self.lora_variant or (not isinstance(dropout, nn.Identity) and dropout.training):
            return None
        return adapter

    def _get_in_out_features(self, module: nn.Module) -> tuple[int, int]:
        if isinstance(module, FrozenLinear):
            return module.in_features, module.out_features
        return super()._get_in_out_features(module)

    def merge(self, safe_merge: bool = False, adapter_names=None) -> None:
        raise NotImplementedError(
            "A LoRA adapter cannot be merged into an NVFP4 FrozenLinear without losing precision. Load the "
            "saved adapter on the full-precision base instead: "
            "PeftModel.from_pretrained(base, adapter_dir).merge_and_unload()."
        )

    def unmerge(self) -> None:
        raise NotImplementedError("PactLoraLinear never merges, so there is nothing to unmerge.")


def dispatch_pact(target: nn.Module, adapter_name: str, config, **kwargs) -> PactLoraLinear | None:
    """Wrap `target` (an `nn.Linear` or a `FrozenLinear`) with LoRA, quantizing an `nn.Linear` to NVFP4 first.

    The layer's precision comes from `config.precision_plan` (by peft's `target_name`; absent means nvfp4).
    Returns None for a linear whose in_features is not a multiple of 16 (NVFP4 blocks): peft then gives it a plain
    LoRA layer on its full-precision weight, and the reason is logged.
    """
    base = target.get_base_layer() if isinstance(target, BaseTunerLayer) else target
    name = kwargs.get("target_name") or type(base).__name__
    protected = getattr(config, "protected_modules", None) or ()
    precision = "fp16" if name in protected else (config.precision_plan or {}).get(name, "nvfp4")
    if isinstance(base, nn.Linear):
        config.base_dtype = str(base.weight.dtype).removeprefix("torch.")  # what the frozen weights are built from
        if base.in_features % 16:
            logger.warning(
                "PACT leaves %s unquantized: in_features=%d is not a multiple of 16 (NVFP4 block size).",
                name,
                base.in_features,
            )
            return None
        if needs_whole_model(config):  # AQLoRA ranks all targeted layers first: quantized when peft is done
            group = config.__dict__.setdefault("_pact_pending", {}).get(adapter_name)
            if group is None or group.done:
                group = config._pact_pending[adapter_name] = PendingLayers(config, adapter_name)
            layer = PactLoraLinear(base, adapter_name, config=config, **kwargs)
            group.add(name, layer)
            return layer
        base = FrozenLinear.from_linear(base, backend=config.get_backend(), precision=precision)
    elif isinstance(base, FrozenLinear) and base.precision != precision:
        raise ValueError(
            f"PactConfig keeps {name} in {precision} (precision_plan, protected_modules), but the model was loaded "
            f"with it already {base.precision}. Load the unquantized base model, or drop the layer from the plan."
        )
    return PactLoraLinear(base, adapter_name, config=config, **kwargs)
