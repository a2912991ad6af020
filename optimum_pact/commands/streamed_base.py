"""The main job's base without its full-precision copy: what `pact finetune` trains on, built one weight at a time.

`get_peft_model` on a loaded 16-bit model holds every full-precision weight at once before it quantizes them: at 1.5B
parameters that is 3 GiB in bf16 before training starts. When AQLoRA's protected linears can be known from the weights
alone (`rank_by` "nvfp4" or "nf4", no calibration batch), `pact finetune` instead

1. ranks the targeted linears here, reading each weight from the checkpoint on its own (a file handle per weight, so
   no page of the file stays mapped) and computing its reconstruction error in the training dtype: the list
   `get_peft_model` would have chosen from the loaded model, the same ties broken the same way. The errors depend
   on the checkpoint, the dtype and the format alone, so they are kept in PACT's cache (`ranking/`, keyed as the
   packed base is: `checkpoint_key`) and read back on the next run: 45 s of every 1.5B run on 2 cores, otherwise;
2. loads the base through PACT's transformers quantizer with those linears 16-bit (`load_packed`: every other linear
   quantized while it is read, the result cached, and read from the cache the next time): the same model
   `PactModelForCausalLM` builds for the saved adapter, so what was trained is what runs.
"""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path

import torch
from peft.tuners.tuners_utils import _maybe_include_all_linear_layers, check_target_module_exists
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM

from peft_ext import PactConfig
from peft_ext.blocks import decoder_linears
from peft_ext.ranking import ERROR_FORMATS, choose_protected, error_format, reconstruction_error

from ..cache import cache_dir
from ..dataflow import FrozenLinear
from ..files import write_text_atomic
from ..nvfp4 import BLOCK_SIZE
from ..quantizer import PactQuantizationConfig
from .packed_cache import checkpoint_key, load_packed

logger = logging.getLogger(__name__)
RANKING_FORMAT = 1  # raise when how an error is computed changes


def streams(config: PactConfig, path: str) -> bool:
    """Whether the base for `config` can be built without a full-precision copy: a local safetensors checkpoint, and
    nothing to measure on the unquantized model (no calibration batch: no precision budget, no sensitivity ranking)."""
    if config.uses_calibration or config.rank_by not in (*ERROR_FORMATS, "auto"):
        return False
    if config.adapt == "speed" or config.precision_plan:
        return False
    return _checkpoint_files(Path(path)) is not None


def _checkpoint_files(folder: Path) -> dict[str, Path] | None:
    """Tensor name -> the safetensors file holding it, or None where there is no local safetensors checkpoint."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: folder / file for name, file in weight_map.items()}
    single = folder / "model.safetensors"
    if not single.is_file():
        return None
    with safe_open(str(single), framework="pt") as reader:
        return dict.fromkeys(reader.keys(), single)


def targeted_linears(config: PactConfig, path: str) -> tuple[dict[str, torch.nn.Linear], PactConfig]:
    """The decoder linears `get_peft_model(model, config)` targets, found on a weightless (meta-device) skeleton,
    and `config` with "all-linear" spelled out as peft expands it (on a base of FrozenLinear layers, which are no
    `nn.Linear`, peft would find none)."""
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    expanded = _maybe_include_all_linear_layers(copy.copy(config), skeleton)
    config = config._replace(target_modules=expanded.target_modules)
    linears = decoder_linears(skeleton).items()
    return {name: layer for name, layer in linears if check_target_module_exists(expanded, name)}, config


def protected_from_checkpoint(config: PactConfig, path: str, dtype: torch.dtype) -> tuple[PactConfig, list[str]]:
    """AQLoRA's protected list from the checkpoint, one weight in memory at a time (see the module's docstring), and
    `config` with its target modules spelled out."""
    linears, config = targeted_linears(config, path)
    if config.protected_modules is not None:
        return config, list(config.protected_modules)
    if not config.protect_fraction:
        return config, []
    fmt = error_format(config.rank_by)
    # a linear NVFP4 cannot hold stays a plain LoRA on its full-precision weight in peft: not ranked
    ranked = [name for name, layer in linears.items() if not layer.in_features % BLOCK_SIZE]
    files = _checkpoint_files(Path(path))
    cached = cache_dir("ranking", checkpoint_key(Path(path), sorted(set(files.values())), ranked, str(dtype), fmt,
                                                 RANKING_FORMAT) + ".json")  # fmt: skip
    ranking = _cached_ranking(cached, ranked)
    if ranking is None:
        ranking = []
        for name in ranked:
            with safe_open(str(files[f"{name}.weight"]), framework="pt") as reader:  # closed: its pages unmapped
                weight = reader.get_tensor(f"{name}.weight").to(dtype)
            ranking.append((name, reconstruction_error(weight, fmt)))
            del weight
        _cache_ranking(cached, ranking)
    return config, choose_protected(ranking, config.protect_fraction)


def _cached_ranking(file: Path, names: list[str]) -> list[tuple[str, float]] | None:
    """The errors cached in `file` for `names`, in order; None where there are none (or damaged ones)."""
    try:
        ranking = [(str(name), float(error)) for name, error in json.loads(file.read_text())]
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError) as err:  # damaged: ranked again and rewritten
        logger.warning("the cached ranking %s did not read (%s); ranking the linears again", file, err)
        return None
    return ranking if [name for name, _ in ranking] == names else None


def _cache_ranking(file: Path, ranking: list[tuple[str, float]]) -> None:
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(file, json.dumps(ranking))  # floats as repr: read back bit for bit
    except OSError as err:  # a full or read-only cache costs the next run the ranking's time, nothing else
        logger.warning("could not cache the ranking in %s (%s); the next run ranks again", file, err)


def load_streamed_base(config: PactConfig, path: str, given: str | None, dtype: torch.dtype):
    """(base, config): the base on PACT's NVFP4 layers with AQLoRA's protected linears 16-bit, and `config` with
    that list and the base dtype recorded, ready for `get_peft_model(base, config)`."""
    config, protected = protected_from_checkpoint(config, path, dtype)
    config = config._replace(protected_modules=protected)
    config.base_dtype = str(dtype).removeprefix("torch.")  # what the frozen weights are built from
    quantization = PactQuantizationConfig(backend=config.backend, backend_options=config.backend_options,
                                          modules_in_16bit=config.sixteen_bit_modules() or None)  # fmt: skip
    base = load_packed(path, given, quantization, dtype)
    backend = config.get_backend()  # one backend for the model: the one whose products the summary counts
    for module in base.modules():
        if isinstance(module, FrozenLinear):
            module.backend, module._handle = backend, None
    return base, config


__all__ = ["load_streamed_base", "protected_from_checkpoint", "streams", "targeted_linears"]
