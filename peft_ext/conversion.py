"""Putting a model that was not built with `PactConfig` on PACT's base, from `PactOptions`.

This is what `PactTrainer` does with `PactTrainingArguments`' model-side options, so a script that builds a plain
`LoraConfig` (or receives an already-wrapped peft model) gets NVFP4 frozen linears, the chosen backend and AQLoRA
from its training arguments alone:

* a peft model with plain LoRA layers (one adapter) is wrapped again with the `PactConfig` of its own LoRA settings
  plus the options, and its adapter weights are copied over unchanged (the speed setting keeps the top blocks'
  adapters, as `PactConfig` does). Same seed, same result as building it with that `PactConfig` in the first place;
* a bare transformers model gets its decoder linears as `FrozenLinear` (the protected ones 16-bit) on one backend;
* a model built with `PactConfig` is left alone, but every option given must agree with its config.
"""

from __future__ import annotations

import dataclasses

from peft import LoraConfig, PeftModel, PeftType, get_peft_model
from peft.utils import get_peft_model_state_dict, set_peft_model_state_dict
from torch import nn

from optimum_pact.backends import get_backend
from optimum_pact.dataflow import FrozenLinear
from optimum_pact.nvfp4 import BLOCK_SIZE

from .blocks import decoder_linears
from .config import PactConfig
from .options import PactOptions
from .ranking import choose_protected


def apply_pact_options(
    model: nn.Module,
    options: PactOptions,
    given: dict,
    convert: bool = True,
    prefix: str = "",
    calibration_batch: dict | None = None,
) -> nn.Module:
    """The model to train with `options` (see the module doc); `model` itself when it already has PACT's base, or
    when `convert` is False and it was not built with `PactConfig`.

    `given` are the options the user set (name -> value): for a `PactConfig` model they must equal its config's,
    else a ValueError names both (options as `prefix + name`). `calibration_batch` is needed for a precision budget.
    """
    if not convert and not isinstance(_pact_config(model), PactConfig):
        return model
    if isinstance(model, PeftModel):
        if len(model.peft_config) != 1:
            raise ValueError(
                f"PACT's training options apply to a peft model with one adapter; this one has "
                f"{sorted(model.peft_config)}. Build it with PactConfig instead (peft_ext.PactConfig)."
            )
        ((adapter, config),) = model.peft_config.items()
        if isinstance(config, PactConfig):
            _check_agreement(config, given, prefix)
            return model
        if config.peft_type != PeftType.LORA:
            raise ValueError(
                f"PACT's training options need LoRA adapters; the model's adapter {adapter!r} is "
                f"{config.peft_type.value}. Use peft's LoraConfig (or PactConfig)."
            )
        return _rewrap_lora(model, adapter, config, options, calibration_batch, prefix)
    if any(isinstance(m, FrozenLinear) for m in model.modules()):
        return model  # loaded with PactQuantizationConfig: its base is PACT's already
    return _quantize_bare(model, options, prefix)


def _pact_config(model: nn.Module):
    configs = getattr(model, "peft_config", None)
    return next(iter(configs.values())) if isinstance(configs, dict) and len(configs) == 1 else None


def _check_agreement(config: PactConfig, given: dict, prefix: str) -> None:
    differing = {name: value for name, value in given.items() if getattr(config, name) != value}
    if differing:
        pairs = "; ".join(
            f"{prefix}{name}={value!r} but the model's PactConfig.{name}={getattr(config, name)!r}"
            for name, value in differing.items()
        )
        raise ValueError(
            f"The training arguments disagree with the model's PactConfig: {pairs}. Set them equal, or leave them "
            "at their defaults to use the model's."
        )


def _rewrap_lora(
    model: PeftModel, adapter: str, lora: LoraConfig, options: PactOptions, batch: dict | None, prefix: str
) -> PeftModel:
    values = {f.name: getattr(lora, f.name) for f in dataclasses.fields(LoraConfig) if f.init}
    config = PactConfig(**values, **dataclasses.asdict(options))
    weights = get_peft_model_state_dict(model, adapter_name=adapter)
    base = model.unload()
    if config.needs_calibration and batch is None:
        raise ValueError(
            f"{prefix}{config.calibration_option} needs a calibration batch (PactTrainer takes it from the train "
            "data)."
        )
    if batch is not None:
        config = config.with_calibration(base, batch)  # returned as it is when it uses no batch
    wrapped = get_peft_model(base, config, adapter_name=adapter)
    loaded = set_peft_model_state_dict(wrapped, weights, adapter_name=adapter)
    missing = [key for key in loaded.missing_keys if "lora_" in key]
    if missing:
        raise RuntimeError(f"adapter weights did not carry over to the PACT model: {missing[:5]}")
    return wrapped


def _quantize_bare(model: nn.Module, options: PactOptions, prefix: str) -> nn.Module:
    if options.adapt == "speed" or options.needs_calibration:  # the probe measures adapter gradients
        name = "adapt='speed'" if options.adapt == "speed" else options.calibration_option
        raise ValueError(
            f"{prefix}{name} needs LoRA adapters, and this model has none: wrap it with peft first "
            "(get_peft_model with LoraConfig or PactConfig)."
        )
    protected = set(
        choose_protected(model, options.protect_fraction, options.rank_by) if options.protect_fraction else ()
    )
    backend = get_backend(options.backend, **(options.backend_options or {}))
    for name, linear in decoder_linears(model).items():
        if linear.in_features % BLOCK_SIZE == 0:
            frozen = FrozenLinear.from_linear(linear, backend, precision="fp16" if name in protected else "nvfp4")
            model.set_submodule(name, frozen)
    return model


__all__ = ["apply_pact_options"]
