"""The gradient-sensitivity probe: per frozen linear, how much NVFP4 instead of 16-bit weights moves the gradients.

One reference forward+backward on a calibration batch with every frozen linear at its full-precision weight records,
per layer, the input `x` and output gradient `dy` (local errors, below), and all adapter gradients `g`. Then, for
each layer in turn, its weight is swapped for the effective NVFP4 weight `deq(q(W))` and the pass is repeated:
the relative change of all adapter gradients is that layer's `adapter_grad_change` (the quantity training feels).
This works on any model whose frozen linears are `nn.Linear` and whose trainable parameters are the adapters
(e.g. a peft LoRA model on the unquantized base); it imports nothing from peft.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from ..nvfp4 import BLOCK_SIZE, quantize
from .plan import LayerSensitivity


def frozen_linears(model: nn.Module) -> dict[str, nn.Linear]:
    """The linears NVFP4 could hold: frozen weight, in_features a multiple of 16, not the output embedding."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return {
        name: m
        for name, m in model.named_modules()
        if type(m) is nn.Linear and not m.weight.requires_grad and m.in_features % BLOCK_SIZE == 0 and m is not head
    }


def _relative(diff: torch.Tensor, ref: torch.Tensor) -> float:
    norm = float(ref.norm())
    return float(diff.norm()) / norm if norm > 0 else 0.0


def _adapter_grads(params: list[nn.Parameter]) -> torch.Tensor:
    grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in params]
    return torch.cat([g.detach().float().flatten() for g in grads])


@torch.no_grad()
def _effective_nvfp4(weight: torch.Tensor) -> torch.Tensor:
    return quantize(weight.detach().float()).dequantize(torch.float32)


def probe_sensitivity(
    model: nn.Module,
    batch: Mapping[str, torch.Tensor],
    layers: Mapping[str, nn.Linear] | None = None,
    adapter_grads: bool = True,
) -> list[LayerSensitivity]:
    """Measure every layer of `layers` (default: `frozen_linears(model)`) on one calibration `batch`.

    `model(**batch).loss` must be the training loss. `adapter_grads=False` skips the one-pass-per-layer global
    measurement and keeps only the local errors (one pass in all). Dropout is off during the probe; the model's
    weights and mode are restored afterwards.
    """
    layers = dict(frozen_linears(model) if layers is None else layers)
    if not layers:
        raise ValueError("probe_sensitivity found no frozen nn.Linear with in_features a multiple of 16 to probe.")
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError(
            "probe_sensitivity needs the adapter parameters to be trainable: probe a model with LoRA adapters "
            "(e.g. get_peft_model(model, LoraConfig(...))), not a frozen base."
        )
    was_training = model.training
    model.eval()
    quantized: dict[str, torch.Tensor] = {}
    local: dict[str, list[float]] = {name: [0.0, 0.0] for name in layers}  # output error, input-grad error
    hooks = []

    def record(name: str, linear: nn.Linear):
        def hook(module, args, out):
            x = args[0].detach().reshape(-1, linear.in_features).float()
            w = linear.weight.detach().float()
            wq = quantized.setdefault(name, _effective_nvfp4(linear.weight))
            local[name][0] = _relative(x @ (wq - w).t(), x @ w.t())
            if out.requires_grad:

                def on_grad(dy):
                    dy = dy.detach().reshape(-1, linear.out_features).float()
                    local[name][1] = _relative(dy @ (wq - w), dy @ w)

                out.register_hook(on_grad)

        return hook

    def inputs_need_grad(module, args, out):  # so every layer sees an output gradient, the first block's too
        return out.requires_grad_(True) if out.is_floating_point() else out

    try:
        embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        if embeddings is not None:
            hooks.append(embeddings.register_forward_hook(inputs_need_grad))
        hooks += [linear.register_forward_hook(record(name, linear)) for name, linear in layers.items()]
        reference = _pass(model, batch, params)
        for h in hooks[1:] if embeddings is not None else hooks:
            h.remove()
        results = []
        for name, linear in layers.items():
            change = None
            if adapter_grads:
                original = linear.weight.data
                linear.weight.data = quantized[name].to(original.dtype)
                try:
                    change = _relative(_pass(model, batch, params) - reference, reference)
                finally:
                    linear.weight.data = original
            results.append(LayerSensitivity(name, linear.out_features, linear.in_features, *local[name], change))
        return results
    finally:
        for h in hooks:
            h.remove()
        for p in params:
            p.grad = None
        model.train(was_training)


def _pass(model: nn.Module, batch: Mapping[str, torch.Tensor], params: list[nn.Parameter]) -> torch.Tensor:
    for p in params:
        p.grad = None
    model(**batch).loss.backward()
    return _adapter_grads(params)
