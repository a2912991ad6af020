"""The `pact` quantization method for `transformers`: NVFP4 frozen linears, quantized while loading.

Importing this module registers `PactQuantizationConfig` and `PactHfQuantizer` under the quant method `"pact"`
(through transformers' public `register_quantization_config` / `register_quantizer`) and wraps
`AutoHfQuantizer.merge_quantization_configs` so that options passed when reloading a pact checkpoint are applied
(see below); it does nothing else.

* `from_pretrained(path, quantization_config=PactQuantizationConfig())` on a full-precision checkpoint swaps every
  eligible `nn.Linear` of the meta-device skeleton for a `FrozenLinear` before any weight is read. Transformers'
  loader then streams the checkpoint one tensor at a time and runs `PactQuantize` on each of those weights, so the
  full-precision model never exists in memory: the peak is the packed model plus one full-precision weight (and the
  quantizer's temporaries for it).
* `save_pretrained` writes the `FrozenLinear` buffers as they are (the ModelOpt NVFP4 layout: `weight` uint8,
  `weight_scale` F8_E4M3, `weight_scale_2` F32) with `quantization_config = {"quant_method": "pact", ...}` in
  config.json; `from_pretrained(dir)` rebuilds the same skeleton and copies the packed tensors in, without quantizing.
* Nothing loads as garbage: before any weight is read, the checkpoint's safetensors headers are checked (every
  packed tensor of a layer there, with its dtype and shape; no packed tensor of a layer kept in full precision), and
  after loading every `FrozenLinear` tensor must have come from the checkpoint, fit, and hold sane scales
  (`FrozenLinear.weight_problems`). Otherwise loading fails with a ValueError naming every such tensor.
* `from_pretrained(dir, quantization_config=PactQuantizationConfig(...))` loads the saved layout with the passed
  runtime options (`backend`, `backend_options`); a passed `modules_to_not_convert` other than the saved one is
  refused (`merge_pact_configs`). Transformers alone would keep the saved config and drop the passed one.

Kept in full precision: `lm_head` (and whatever else transformers' `get_keys_to_not_convert` finds: tied and output
embeddings), `modules_to_not_convert`, `_keep_in_fp32_modules`, and every linear whose `in_features` is not a
multiple of 16 (named once in the log).
"""

from __future__ import annotations

import copy
import logging
import os
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

# The one place that touches transformers' loading internals. On-the-fly quantization in transformers 5.x:
# `HfQuantizer.get_quantize_ops()` returns a `ConversionOps` whose `convert(input_dict, model=..., **kwargs)` gets
# `{full_param_name: tensor or [tensor]}` for each parameter that `param_needs_quantization` accepted and returns
# `{full_name: tensor}` for every tensor to set on the model. `should_convert_module` gives `modules_to_not_convert`
# the same matching rules as the built-in quantizers. tests/test_quantizer.py::test_transformers_loading_contract
# fails loudly if this contract changes.
# Reloading (tests/test_loading.py::test_transformers_reload_contract guards these three):
# * `from_pretrained` passes `checkpoint_files` (the resolved local files) to `_process_model_before_weight_loading`.
# * The loader marks each tensor it sets from the checkpoint with the attribute `LOADED_FLAG` (its own record of what
#   not to initialize); a key missing from the checkpoint gets an uninitialized tensor without it. No quantizer hook
#   is told the missing keys.
# * `get_hf_quantizer` merges a passed quantization_config with the saved one in
#   `AutoHfQuantizer.merge_quantization_configs`, which keeps the saved config of a non-builtin method whole.
from transformers.core_model_loading import ConversionOps
from transformers.quantizers import AutoHfQuantizer, HfQuantizer, register_quantization_config, register_quantizer
from transformers.quantizers.quantizers_utils import should_convert_module
from transformers.utils.quantization_config import QuantizationConfigMixin

from .backends import Backend, get_backend
from .backends.options import check_backend_choice
from .dataflow.linear import PACKED_NAMES, FrozenLinear
from .head import prepare_head
from .nvfp4 import BLOCK_SIZE, quantize

logger = logging.getLogger(__name__)

LOADED_FLAG = "_is_hf_initialized"


def _loaded_by_transformers(tensor: torch.Tensor) -> bool:
    """Whether transformers' loader set `tensor` from the checkpoint (False for a missing key's placeholder)."""
    return bool(getattr(tensor, LOADED_FLAG, False))


QUANT_METHOD = "pact"
_FIELDS = ("backend", "backend_options", "modules_to_not_convert", "modules_in_16bit")
_LOADING_FIELDS = ("backend", "backend_options")  # what a reload may change: how layers compute, not what they hold
# safetensors' names of the dtypes a FrozenLinear holds
_SAFETENSORS_DTYPES = {
    torch.uint8: "U8",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
}


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
        modules_in_16bit: exact names of linears held 16-bit as `FrozenLinear(precision="fp16")` (the same
            backend products, no dequantization): the layers an adapter was trained with 16-bit (AQLoRA's protected
            linears, a precision plan's fp16 ones), rebuilt from the original weights as training built them.
    """

    def __init__(
        self,
        backend: str = "torch",
        backend_options: dict | None = None,
        modules_to_not_convert: list[str] | None = None,
        modules_in_16bit: list[str] | None = None,
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
        dense = modules_in_16bit
        self.modules_in_16bit = sorted(dense) if isinstance(dense, (tuple, set, frozenset)) else dense
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
        dense = self.modules_in_16bit
        if dense is not None and (not isinstance(dense, list) or not all(isinstance(name, str) for name in dense)):
            raise ValueError(
                f"PactQuantizationConfig.modules_in_16bit={dense!r} is invalid; pass None or a list of module names, "
                "e.g. ['model.layers.0.mlp.down_proj'] (an adapter's PactConfig.sixteen_bit_modules())."
            )

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        if out.get("modules_in_16bit") is None:  # all NVFP4: config.json as optimum-pact 0.1 wrote it
            out.pop("modules_in_16bit", None)
        return out

    def get_loading_attributes(self) -> dict[str, Any]:
        """The fields that `from_pretrained(pact_checkpoint, quantization_config=self)` applies over the saved ones:
        the runtime options. `modules_to_not_convert` is not one: it fixed which layers the checkpoint holds packed."""
        return {name: copy.deepcopy(getattr(self, name)) for name in _LOADING_FIELDS}


def merge_pact_configs(saved: PactQuantizationConfig, passed: PactQuantizationConfig) -> PactQuantizationConfig:
    """The config a saved pact checkpoint loads with when `from_pretrained` also got `quantization_config=passed`:
    the saved layout with the passed runtime options (`passed.get_loading_attributes()`: backend, backend_options).

    A passed `modules_to_not_convert` or `modules_in_16bit` (not None) naming other modules than the saved one is a
    ValueError: the checkpoint holds those layers packed or not, and loading cannot change that.
    """
    for name in ("modules_to_not_convert", "modules_in_16bit"):
        _check_layout_unchanged(name, getattr(saved, name), getattr(passed, name))
    merged = PactQuantizationConfig(**{**saved.to_dict(), **passed.get_loading_attributes()})
    changed = {
        name: getattr(merged, name) for name in _LOADING_FIELDS if getattr(merged, name) != getattr(saved, name)
    }
    if changed:
        logger.info("optimum-pact: loading the pact checkpoint with the passed %s (saved: %s).", changed, saved)
    return merged


def _check_layout_unchanged(name: str, kept: list[str] | None, requested: list[str] | None) -> None:
    """A passed layout field (`modules_to_not_convert`, `modules_in_16bit`) must be None or the saved one."""
    if requested is not None and set(requested) != set(kept or []):
        raise ValueError(
            f"from_pretrained got PactQuantizationConfig({name}={requested!r}) for a pact checkpoint saved with "
            f"{name}={kept!r}. Which layers a checkpoint holds in NVFP4 is fixed when it is saved, so loading cannot "
            f"change it: pass {name}=None (or the saved list) to load it, or quantize the full-precision checkpoint "
            "again with the new list. backend and backend_options may change at load."
        )


_current_merge = AutoHfQuantizer.merge_quantization_configs.__func__
_upstream_merge = getattr(_current_merge, "_pact_upstream", _current_merge)  # this module imported again: wrap once


def _merge_configs(cls, quantization_config, quantization_config_from_args):
    """`AutoHfQuantizer.merge_quantization_configs`, except that a saved pact config and a passed one merge through
    `merge_pact_configs` (transformers would keep the saved one and drop the passed options with a warning)."""
    saved = quantization_config
    if isinstance(saved, dict) and saved.get("quant_method") == QUANT_METHOD:
        saved = PactQuantizationConfig.from_dict(saved)
    if isinstance(saved, PactQuantizationConfig) and isinstance(quantization_config_from_args, PactQuantizationConfig):
        return merge_pact_configs(saved, quantization_config_from_args)
    return _upstream_merge(cls, quantization_config, quantization_config_from_args)


_merge_configs._pact_upstream = _upstream_merge
AutoHfQuantizer.merge_quantization_configs = classmethod(_merge_configs)


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
            if module.precision == "fp16":  # held 16-bit: cast as `FrozenLinear.from_linear` copies it
                output[key] = tensor.detach().to(module.weight.dtype)
                continue
            packed = quantize(tensor.detach())  # the same call `FrozenLinear.from_linear` makes: bit-identical
            stem = f"{prefix}." if prefix else ""
            output[key] = packed.qdata
            output[f"{stem}weight_scale"] = packed.scale
            output[f"{stem}weight_scale_2"] = packed.scale_2
        return output


def _module_of(path: str, modules: dict[str, nn.Module], prefix: str) -> str | None:
    """The name in `modules` of the module a checkpoint names `path`: as is, or with the base model's `prefix`
    added or removed (a base model loads its task model's checkpoint and back); None if there is none."""
    candidates = [path]
    if prefix:
        candidates += [f"{prefix}.{path}" if path else prefix, path.removeprefix(f"{prefix}.")]
    return next((name for name in candidates if name in modules), None)


def replace_with_frozen_linear(
    model: nn.Module,
    backend: Backend,
    modules_to_not_convert: list[str] | None = None,
    modules_in_16bit: list[str] | None = None,
) -> tuple[list[str], list[str]]:
    """Swap each plain `nn.Linear` of `model` (outside `modules_to_not_convert`) for an empty `FrozenLinear`, NVFP4,
    or 16-bit for the names in `modules_in_16bit`.

    Runs on the meta-device skeleton before loading: the new layers keep the old device and bias dtype, hold no
    weight yet and all share `backend`. Returns `(converted, skipped)`: skipped layers have `in_features % 16 != 0`
    and stay `nn.Linear`. Only exact `nn.Linear` instances are swapped; subclasses may compute something else. A
    name in `modules_in_16bit` that is not such a linear is a ValueError (the adapter was trained on another model).
    """
    converted, skipped = [], []
    dense = set(modules_in_16bit or ())
    for name, module in list(model.named_modules()):
        if type(module) is not nn.Linear or not should_convert_module(name, modules_to_not_convert):
            continue
        if module.in_features % BLOCK_SIZE:
            skipped.append(f"{name} (in_features={module.in_features})")
            continue
        precision = "fp16" if name in dense else "nvfp4"
        model.set_submodule(name, FrozenLinear.empty_like(module, backend=backend, precision=precision))
        converted.append(name)
    unknown = sorted(dense - set(converted))
    if unknown:
        raise ValueError(
            f"PactQuantizationConfig.modules_in_16bit names {len(unknown)} module(s) that are not linears PACT puts "
            f"on its base in this model: {unknown[:3]}. Load the base the adapter was trained on."
        )
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
        # FrozenLinear tensors the checkpoint's safetensors headers hold: model name -> (key in the file, dtype, shape)
        self._stored: dict[str, tuple[str, str, list[int]]] = {}
        self._checkpoint_dir: str | None = None

    def validate_environment(self, *args, **kwargs) -> None:
        config = self.quantization_config
        self.backend = get_backend(config.backend, **(config.backend_options or {}))  # fails before the model is built

    def param_needs_quantization(self, model: nn.Module, param_name: str, **kwargs) -> bool:
        if self.pre_quantized:
            return False
        prefix, _, name = param_name.rpartition(".")
        return name == "weight" and isinstance(model.get_submodule(prefix), FrozenLinear)

    def _process_model_before_weight_loading(self, model: nn.Module, checkpoint_files=None, **kwargs) -> None:
        config = self.quantization_config
        self.modules_to_not_convert = self.get_modules_to_not_convert(
            model, config.modules_to_not_convert, model._keep_in_fp32_modules, add_default_skips=True
        )
        if self.backend is None:
            self.backend = get_backend(config.backend, **(config.backend_options or {}))
        self.converted, self.skipped = replace_with_frozen_linear(
            model, self.backend, self.modules_to_not_convert, config.modules_in_16bit
        )
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
        problems = self._read_checkpoint_headers(model, checkpoint_files or [])
        if problems:
            raise self._refusal(problems)

    def _read_checkpoint_headers(self, model: nn.Module, files: list[str]) -> list[str]:
        """Note which FrozenLinear tensors the safetensors files hold (`self._stored`, from their headers: no tensor
        is read) and, for a pact checkpoint, return what is wrong with them: a layer with some of its packed tensors
        but not all, one stored with the wrong dtype or shape, a packed scale of a layer that is not a FrozenLinear.

        A checkpoint key names a module as the model does, or with its `base_model_prefix` added or removed (the
        loader's own rule); a key that names no module here (e.g. one the model's conversion mapping renames) is
        left to the check after loading.
        """
        files = [str(file) for file in files if str(file).endswith(".safetensors")]
        if not files:
            return []
        self._checkpoint_dir = os.path.dirname(files[0])
        modules = dict(model.named_modules())
        prefix = getattr(model, "base_model_prefix", "") or ""
        problems = []
        for file in files:
            with safe_open(file, framework="pt") as f:
                for key in f.keys():
                    path, _, name = key.rpartition(".")
                    module_name = _module_of(path, modules, prefix)
                    if module_name is None:
                        continue
                    module = modules[module_name]
                    if isinstance(module, FrozenLinear) and name in module.layout():
                        stored = f.get_slice(key)
                        self._stored[f"{module_name}.{name}"] = (key, stored.get_dtype(), list(stored.get_shape()))
                    elif self.pre_quantized and name in PACKED_NAMES[1:] and getattr(module, name, None) is None:
                        what = "a FrozenLinear holding a 16-bit weight" if isinstance(module, FrozenLinear) else None
                        problems.append(
                            f"{key}: unexpected, {module_name} is {what or f'a {type(module).__name__}'} (not packed "
                            "as NVFP4 here), which has no such tensor"
                        )
        if not self.pre_quantized:
            return problems
        for name in self.converted:
            layer = modules[name]
            found = {tensor: self._stored.get(f"{name}.{tensor}") for tensor in layer.layout()}
            if not any(found.values()):  # not under this name in the file: the check after loading covers it
                continue
            for tensor, (dtype, shape) in layer.layout().items():
                if found[tensor] is None:
                    problems.append(f"{name}.{tensor}: missing from the checkpoint")
                    continue
                key, stored_dtype, stored_shape = found[tensor]
                expected = _SAFETENSORS_DTYPES.get(dtype, str(dtype))
                if stored_dtype != expected:
                    problems.append(f"{key}: stored as {stored_dtype}, must be {expected}")
                elif stored_shape != list(shape):
                    problems.append(f"{key}: shape {stored_shape}, must be {list(shape)}")
        return problems

    def _in_checkpoint(self, layer: str, tensor: str) -> bool:
        """Whether the checkpoint's headers hold `layer`'s `tensor` (a full-precision checkpoint: its weight)."""
        return f"{layer}.{tensor if self.pre_quantized else 'weight'}" in self._stored

    def _refusal(self, problems: list[str]) -> ValueError:
        where = f" {self._checkpoint_dir}" if self._checkpoint_dir else ""
        if self.pre_quantized:
            head = f"optimum-pact cannot load the pact checkpoint{where}: its NVFP4 FrozenLinear layers would compute"
            fix = (
                "The checkpoint is incomplete or was changed after save_pretrained wrote it: save the model again "
                "with save_pretrained, or quantize its full-precision checkpoint again (from_pretrained(path, "
                "quantization_config=PactQuantizationConfig()), then save_pretrained)."
            )
        else:
            head = f"optimum-pact cannot quantize the checkpoint{where}: its NVFP4 FrozenLinear layers would compute"
            fix = "Every layer quantized while loading needs its full-precision weight: load a complete checkpoint."
        return ValueError(f"{head} with garbage:\n  - " + "\n  - ".join(problems) + f"\n{fix}")

    def _process_model_after_weight_loading(self, model: nn.Module, **kwargs) -> nn.Module:
        layers = [(name, module) for name, module in model.named_modules() if isinstance(module, FrozenLinear)]
        problems = []
        for name, layer in layers:
            # A tensor counts as loaded when the loader marked it or the checkpoint's header holds it (accelerate's
            # dispatch may have moved it to another device since, dropping the mark). Not loaded: uninitialized.
            loaded = {
                tensor: getattr(layer, tensor)
                for tensor in layer.layout()
                if _loaded_by_transformers(getattr(layer, tensor)) or self._in_checkpoint(name, tensor)
            }
            problems += layer.weight_problems(loaded, prefix=f"{name}.", source="the checkpoint")
        if problems:
            raise self._refusal(problems)
        for _, layer in layers:
            # the loader wraps a loaded bias in a fresh Parameter that requires grad: frozen means frozen
            if layer.bias is not None:
                layer.bias.requires_grad_(False)
            if layer.precision == "nvfp4":
                layer.load_nvfp4(layer.nvfp4)  # drops any backend handle
            else:
                layer.release_handle()
        return prepare_head(model)  # plain strides, and decoding's rows in one native pass (head.py)

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
    "LOADED_FLAG",
    "QUANT_METHOD",
    "PactHfQuantizer",
    "PactQuantizationConfig",
    "PactQuantize",
    "merge_pact_configs",
    "replace_with_frozen_linear",
]
