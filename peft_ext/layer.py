"""LoRA on top of a FrozenLinear, and the dispatch that puts it on every targeted linear."""

from __future__ import annotations

import logging

from peft.tuners.lora import Linear as LoraLinear
from peft.tuners.tuners_utils import BaseTunerLayer
from torch import nn

from optimum_pact.dataflow import FrozenLinear

logger = logging.getLogger(__name__)


class PactLoraLinear(LoraLinear):
    """peft's `lora.Linear` whose base layer is a `FrozenLinear`.

    The base product (and its input gradient) runs on the PACT backend from the packed NVFP4 weight; the adapter
    path `lora_B(lora_A(dropout(x))) * scaling` is peft's own, so adapter weights, names and files are plain LoRA.
    """

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

    Returns None for a linear whose in_features is not a multiple of 16 (NVFP4 blocks): peft then gives it a plain
    LoRA layer on its full-precision weight, and the reason is logged.
    """
    base = target.get_base_layer() if isinstance(target, BaseTunerLayer) else target
    if isinstance(base, nn.Linear):
        if base.in_features % 16:
            logger.warning(
                "PACT leaves %s unquantized: in_features=%d is not a multiple of 16 (NVFP4 block size).",
                kwargs.get("target_name") or type(base).__name__,
                base.in_features,
            )
            return None
        base = FrozenLinear.from_linear(base, backend=config.backend, tile_size=config.tile_size)
    return PactLoraLinear(base, adapter_name, config=config, **kwargs)
