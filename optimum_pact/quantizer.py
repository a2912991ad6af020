"""The `pact` quantization method for `transformers`: NVFP4 frozen linears, quantized while loading.

Importing this module registers `PactQuantizationConfig` and `PactHfQuantizer` under the quant method `"pact"`
(through transformers' public `register_quantization_config` / `register_quantizer`) and does nothing else.

* `from_pretrained(path, quantization_config=PactQuantizationConfig())` on a full-precision checkpoint swaps every
  eligible `nn.Linear` of the meta-device skeleton for a `FrozenLinear` before any weight is read. Transformers'
  loader then streams the checkpoint one tensor at a time and runs `PactQuantize` on each of those weights, so the
  full-precision model never exists in memory: the peak is the packed model plus one full-precision weight (and the
  quantizer's temporaries for it).
* `save_pretrained` writes the `FrozenLinear` buffers as they are (the ModelOpt NVFP4 layout: `weight` uint8,
  `weight_scale` F8_E4M3, `weight_scale_2` F32) with `quantization_config = {"quant_method": "pact", ...}` in
  config.json; `from_pretrained(dir)` rebuilds the same skeleton and copies the packed tensors in, without quantizing.

Kept in full precision: `lm_head` (and whatever else transformers' `get_keys_to_not_convert` finds: tied and output
embeddings), `modules_to_not_convert`, `_keep_in_fp32_modules`, and every linear whose `in_features` is not a
multiple of 16 (named once in the log).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

# The one place that touches transformers' loading internals. On-the-fly quantization in transformers 5.x:
# `HfQuantizer.get_quantize_ops()` returns a `ConversionOps` whose `convert(input_dict, model=..., **kwargs)` gets
# `{full_param_name: tensor or [tensor]}` for each parameter that `param_needs_quantization` accepted and returns
# `{full_name: tensor}` for every tensor to set on the model. `should_convert_module` gives `modules_to_not_convert`
# the same matching rules as the built-in quantizers. tests/test_quantizer.py::test_transformers_loading_contract
# fails loudly if this contract changes.
from transformers.core_model_loading import ConversionOps
from transformers.quantizers import HfQuantizer, register_quantization_config, register_quantizer
from transformers.quantizers.quantizers_utils import should_convert_module
from transformers.utils.quantization_config import QuantizationConfigMixin

from .backends import Backend, get_backend
from .backends.options import check_backend_choice
from .dataflow.linear import FrozenLinear
from .nvfp4 import BLOCK_SIZE, quantize

logger = logging.getLogger(__name__)

QUANT_METHOD = "pact"
_FIELDS = ("backend", "backend_options", "modules_to_not_convert")


@register_quantization_config(QUANT_METHOD)
class PactQuantizationConfig(QuantizationConfigMixin):
    """Quantize the decoder linears to NVFP4 `FrozenLinear`s (frozen weights for LoRA training on top).

    Args:
        backend: the backend that computes the frozen products: "torch", "qnn" or "auto" (resolved once per
            loaded model; every layer shares that one instance).
        backend_options: the backend's keyword options, e.g. `{"tile_size": 256}` (torch: rows / columns
            dequantized at a time) or `{"soc_model": "69"}` (qnn).
        modules_to_not_convert: module-name patterns kept in full precision, in addition to `lm_head` (a name, a
            dotted prefix such as `"model.layers.0"`, a regex, or a suffix such as `"mlp.down_proj"`).
    """

    def __init__(
        self,
        backend: str = "torch",
        backend_options: dict | None = None,
        modules_to_not_convert: list[str] | None = None,
        **kwargs: Any,
    ):
        quant_method = kwargs.pop("quant_method", QUANT_METHOD)
        if quant_method != QUANT_METHOD:
            raise ValueError(
                f"PactQuantizationConfig got quant_method={quant_method!r}; it only describes {QUANT_METHOD!r}. "
                "Use the config class registered for that method instead."
            )
        if "tile_size" in kwargs:  # written by optimum-pact 0.1 as its own field: a torch backend option now
            tile_size = kwargs.pop("tile_size")
            if tile_size is not None:
                backend_options = {**(backend_options or {}), "tile_size": tile_size}
        if kwargs:
            raise TypeError(
                f"PactQuantizationConfig got unknown field(s) {sorted(kwargs)}; "
                f"its fields are {', '.join(_FIELDS)}. Remove or rename them."
            )
        self.quant_method = QUANT_METHOD
        self.backend = backend
        self.backend_options = backend_options
        skip = modules_to_not_convert
        self.modules_to_not_convert = list(skip) if isinstance(skip, tuple) else skip
        self.post_init()

    def post_init(self) -> None:
        """Check every field; raise a ValueError that names the field, the value and the fix."""
        self.backend_options = check_backend_choice(self.backend, self.backend_options)
        skip = self.modules_to_not_convert
        if skip is not None and (not isinstance(skip, list) or not all(isinstance(name, str) for name in skip)):
            raise ValueError(
                f"PactQuantizationConfig.modules_to_not_convert={skip!r} is invalid; pass None or a list of "
                "module-name strings, e.g. ['lm_head', 'mlp.down_proj']."
            )


class PactQuantize(ConversionOps):
    """Loading op: quantize each full-precision `<module>.weight` of a `FrozenLinear` into its three NVFP4 tensors."""

    def __init__(self, hf_quantizer: PactHfQuantizer):
        self.hf_quantizer = hf_quantizer

    def convert(self, input_dict: dict[str, Any], model: nn.Module | None = None, **kwargs) -> dict[str, torch.Tensor]:
        output = {}
        for key, value in input_dict.items():
            tensor = value[0] if isinstance(value, list) else value
            prefix, _, name = key.rpartition(".")
            try:
                module = model.get_submodule(prefix) if model is not None else None
            except AttributeError:
                module = None
            if name != "weight" or not isinstance(module, FrozenLinear):
                output[key] = tensor
                continue
            packed = quantize(tensor.detach())  # the same call `FrozenLinear.from_linear` makes: bit-identical
            stem = f"{prefix}." if prefix else ""
            output[key] = packed.qdata
            output[f"{stem}weight_scale"] = packed.scale
            output[f"{stem}weight_scale_2"] = packed.scale_2
        return output


def replace_with_frozen_linear(
    model: nn.Module, backend: Backend, modules_to_not_convert: list[str] | None = None
) -> tuple[list[str], list[str]]:
    """Swap each plain `nn.Linear` of `model` (outside `modules_to_not_convert`) for an empty `FrozenLinear`.

    Runs on the meta-device skeleton before loading: the new layers keep the old device and bias dtype, hold no
    weight yet and all share `backend`. Returns `(converted, skipped)`: skipped layers have `in_features % 16 != 0`
    and stay `nn.Linear`. Only exact `nn.Linear` instances are swapped; subclasses may compute something else.
    """
    converted, skipped = [], []
    for name, module in list(model.named_modules()):
        if type(module) is not nn.Linear or not should_convert_module(name, modules_to_not_convert):
            continue
        if module.in_features % BLOCK_SIZE:
            skipped.append(f"{name} (in_features={module.in_features})")
            continue
        model.set_submodule(name, FrozenLinear.empty_like(module, backend=backend))
        converted.append(name)
    return converted, skipped


@register_quantizer(QUANT_METHOD)
class PactHfQuantizer(HfQuantizer):
    """Quantizes full-precision checkpoints into `FrozenLinear`s weight by weight; loads pact checkpoints as is."""

    requires_calibration = False
    quantization_config: PactQuantizationConfig

    def __init__(self, quantization_config: PactQuantizationConfig, **kwargs):
        super().__init__(quantization_config, **kwargs)
        self.modules_to_not_convert: list[str] = []
        self.converted: list[str] = []
        self.skipped: list[str] = []
        self.backend: Backend | None = None  # the loaded model's one backend, built in validate_environment

    def validate_environment(self, *args, **kwargs) -> None:
        config = self.quantization_config
        self.backend = get_backend(config.backend, **(config.backend_options or {}))  # fails before the model is built

    def param_needs_quantization(self, model: nn.Module, param_name: str, **kwargs) -> bool:
        if self.pre_quantized:
            return False
        prefix, _, name = param_name.rpartition(".")
        return name == "weight" and isinstance(model.get_submodule(prefix), FrozenLinear)

    def _process_model_before_weight_loading(self, model: nn.Module, **kwargs) -> None:
        config = self.quantization_config
        self.modules_to_not_convert = self.get_modules_to_not_convert(
            model, config.modules_to_not_convert, model._keep_in_fp32_modules, add_default_skips=True
        )
        if self.backend is None:
            self.backend = get_backend(config.backend, **(config.backend_options or {}))
        self.converted, self.skipped = replace_with_frozen_linear(model, self.backend, self.modules_to_not_convert)
        if self.skipped:
            logger.warning(
                "optimum-pact: leaving %d linear layer(s) unquantized because NVFP4 needs in_features to be a "
                "multiple of %d: %s",
                len(self.skipped),
                BLOCK_SIZE,
                ", ".join(self.skipped),
            )
        if not self.converted:
            logger.warning("optimum-pact: no linear layer of %s was quantized to NVFP4.", type(model).__name__)

    def _process_model_after_weight_loading(self, model: nn.Module, **kwargs) -> nn.Module:
        for module in model.modules():
            if isinstance(module, FrozenLinear):
                # the loader wraps a loaded bias in a fresh Parameter that requires grad: frozen means frozen
                if module.bias is not None:
                    module.bias.requires_grad_(False)
                module.load_nvfp4(module.nvfp4)  # checks the loaded shapes; drops any backend handle
        return model

    def get_quantize_ops(self) -> PactQuantize:
        return PactQuantize(self)

    def _dequantize(self, model: nn.Module, dtype: torch.dtype | None = None) -> nn.Module:
        """Swap every `FrozenLinear` for an `nn.Linear` holding its dequantized weight (e.g. to merge LoRA into it)."""
        for name, module in list(model.named_modules()):
            if not isinstance(module, FrozenLinear):
                continue
            target = dtype or (module.bias.dtype if module.bias is not None else torch.float32)
            linear = nn.Linear(
                module.in_features,
                module.out_features,
                bias=module.bias is not None,
                dtype=target,
                device=module.weight.device,
            )
            with torch.no_grad():
                linear.weight.copy_(module.dequantize(target))
                if module.bias is not None:
                    linear.bias.copy_(module.bias)
            model.set_submodule(name, linear)
        return model

    def is_serializable(self, *args, **kwargs) -> bool:
        return True

    @property
    def is_trainable(self) -> bool:
        return True


__all__ = [
    "QUANT_METHOD",
    "PactHfQuantizer",
    "PactQuantizationConfig",
    "PactQuantize",
    "replace_with_frozen_linear",
]
