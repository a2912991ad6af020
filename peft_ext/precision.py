"""The gradient-sensitivity probe on a peft model: LoRA on the unquantized base, every targeted linear measured."""

from __future__ import annotations

import dataclasses

import torch
from peft import LoraConfig, get_peft_model
from peft.tuners.lora import LoraLayer
from torch import nn

from optimum_pact.nvfp4 import BLOCK_SIZE
from optimum_pact.precision import LayerSensitivity, probe_sensitivity


def probe_precision(model: nn.Module, batch: dict, config: LoraConfig, **options) -> list[LayerSensitivity]:
    """Measure each linear that `config` targets (names as peft's `target_name`, e.g. `model.layers.0.mlp.up_proj`).

    The probe wraps `model` with plain LoRA adapters of `config`'s LoRA settings (on the full-precision weights),
    runs `optimum_pact.precision.probe_sensitivity` and unloads the adapters again, leaving `model` as it was.
    `options` go to `probe_sensitivity` (e.g. `adapter_grads=False` for the one-pass local measure). The adapters
    are initialized from seed 0 without touching the caller's random state, so the scores depend on the model and
    the batch alone.
    """
    lora_fields = {f.name for f in dataclasses.fields(LoraConfig) if f.init}
    lora = LoraConfig(**{k: v for k, v in config.__dict__.items() if k in lora_fields})
    requires_grad = {name: p.requires_grad for name, p in model.named_parameters()}
    with torch.random.fork_rng(devices=[]):  # the adapters' random init, seeded: the same batch, the same scores
        torch.manual_seed(0)
        peft_model = get_peft_model(model, lora)
    try:
        layers = {
            name: module.get_base_layer()
            for name, module in peft_model.get_base_model().named_modules()
            if isinstance(module, LoraLayer)
            and type(module.get_base_layer()) is nn.Linear
            and module.get_base_layer().in_features % BLOCK_SIZE == 0
        }
        return probe_sensitivity(peft_model, batch, layers, **options)
    finally:
        peft_model.unload()
        for name, p in model.named_parameters():
            p.requires_grad_(requires_grad.get(name, p.requires_grad))
