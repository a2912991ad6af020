"""The fused inference product of a PactLoraLinear, bound once and reused for every decoded token."""

from __future__ import annotations

import torch


class FusedAdapter:
    """What a `PactLoraLinear` runs at inference: its backend's one-call product of the frozen weight and the active
    adapter (`Backend.bind_lora`), or nothing (`product` None: peft's path runs).

    Decoding calls 200+ layers a token; working out which adapter is active, fetching its tensors and binding them to
    the kernel each time cost as much as the products themselves. So that work is done here once, and `current`
    checks, with a few attribute reads, that what it was built from still holds: the same active adapter, adapters
    enabled or not, train / eval mode, the base layer's prepared weight, the adapter's tensors unchanged in place
    (their version counters) and its scaling. The layer drops it when adapters are added, replaced or deleted."""

    __slots__ = ("active", "disabled", "training", "base", "handle", "adapter", "lora", "versions", "scaling")
    __slots__ += ("product",)

    def __init__(self, layer):
        active = layer._active_adapter  # a name or a list of names: copied, so a list changed in place is seen
        self.active = list(active) if isinstance(active, list) else active
        self.disabled, self.training = layer._disable_adapters, layer.training
        self.base = layer.base_layer
        self.handle = self.base.handle  # prepares it if needed; `current` compares it with the base layer's
        self.adapter = layer._plain_adapter((), {})
        self.lora = self.versions = self.scaling = self.product = None
        bind = getattr(self.base.backend, "bind_lora", None)
        if self.adapter is not None and bind is not None:
            a, b = layer.lora_A[self.adapter].weight, layer.lora_B[self.adapter].weight
            self.lora, self.versions, self.scaling = (a, b), (a._version, b._version), layer.scaling[self.adapter]
            self.product = bind(self.handle, a, b, self.scaling)

    def current(self, layer) -> bool:
        if not (
            layer._active_adapter == self.active
            and layer._disable_adapters == self.disabled
            and layer.training == self.training
            and layer._modules["base_layer"] is self.base  # `layer.base_layer` goes through nn.Module.__getattr__
            and self.base._handle is self.handle
        ):
            return False
        if self.lora is None:
            return True
        a, b = self.lora
        return (a._version, b._version) == self.versions and layer.scaling.get(self.adapter) == self.scaling

    def __call__(self, x: torch.Tensor) -> torch.Tensor | None:
        """The layer's output for `x`, or None where the bound product does not take this x (the caller runs peft)."""
        if self.product is None:
            return None
        y = self.product(x)
        if y is None or self.base.bias is None:
            return y
        return y + self.base.bias.to(y.dtype)
