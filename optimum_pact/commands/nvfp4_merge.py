"""`pact export --format nvfp4-merged`: base + adapter merged and re-quantized to NVFP4, in the ModelOpt layout.

Merging into a 4-bit base is where adapters lose their gain: a LoRA change is mostly smaller than the NVFP4 grid
step, so rounding each weight of `deq(W) + delta` to its nearest value puts most of them back where they were. The
target and the rounding are chosen apart, and the export measures what they keep:

- `requantize_from="nvfp4"` (default): the weights the adapter was trained against, `deq(Q(W)) + delta`: the model
  the person was shown. `requantize_from="original"`: the full-precision checkpoint's weight with the delta folded
  in, `W + delta` (W sits anywhere between grid points, so under nearest rounding the delta moves each rounding with
  a probability proportional to its size).
- `rounding="gptq"` (default; `optimum_pact.nvfp4.gptq`): one input column at a time, each rounding error moved onto
  the columns not yet rounded, so that the layer's outputs on the person's own training items (`--data`,
  `calibration.py`) stay where the target puts them. `rounding="nearest"`: each weight to its nearest value alone.
- `size_budget=RATIO` (default 1.3) on top: the merged linears may weigh up to RATIO times their all-NVFP4 form
  (the model's other tensors counted 16-bit); within it, the NVFP4 linears whose rounding moves their outputs most
  (`||(Q - target) X^T||^2` on the training items under gptq, the weight error under nearest) stay bf16, holding
  `deq(Q(W)) + delta` exactly (listed in the config's `modules_to_not_convert`, so the folder reloads as saved).
  On the main job (SmolLM2, 5 seeds) that is 10 of its 157 NVFP4 linears, and the GGUF's llama.cpp accuracy per
  seed is in docs/benchmarks.md (bench_main_job.py). `keep_16bit=FRACTION` keeps that fraction of all linears the
  same way, whatever their size.

Linears the adapter was trained with 16-bit (AQLoRA's protected ones, a precision plan's fp16 ones) are never
rounded to 4 bits: they stay 16-bit with the change merged exactly, listed the same way (and in ModelOpt's
`exclude_modules`).

The export then scores the base, the unmerged adapter and the merged folder as reloaded on the held-out items
(accuracy, or loss for generative data), writes `merge_report.json` beside the weights and warns when the merge
keeps less than 80% of the adapter's gain. ModelOpt's `hf_quant_config.json` goes beside config.json
(`modelopt_config`), for the tools that read ModelOpt checkpoints (vLLM, llama.cpp's converter).
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, DataCollatorForSeq2Seq

from peft_ext.layer import PactLoraLinear

from .. import __version__
from ..dataflow import FrozenLinear
from ..errors import OptionError
from ..nvfp4 import BLOCK_SIZE, NVFP4Tensor, quantize
from ..nvfp4.gptq import gptq_quantize
from ..quantizer import PactQuantizationConfig
from .calibration import calibration_rows, input_hessians
from .finetune import HeldOut, load_data
from .model_folder import check_paths, original_weights, written_aside
from .modeling import PactModelForCausalLM

logger = logging.getLogger(__name__)

REQUANTIZE_FROM = ("nvfp4", "original")
ROUNDINGS = ("gptq", "nearest")  # the merged NVFP4 weights: error-compensating on the training items, or each nearest
WARN_BELOW = 0.8  # of the adapter's gain kept
SIZE_BUDGET = 1.3  # the merged model's size, at most, as a multiple of its all-NVFP4 size: room for the worst linears


@dataclass
class MergeReport:
    metric: str  # "accuracy" (higher is better) or "loss" (lower is better), on the held-out items
    base: float  # the NVFP4 base without the adapter
    adapter: float  # the NVFP4 base with the adapter, unmerged (what training computed)
    merged: float  # the exported folder, reloaded
    gain_kept: float | None  # (merged - base) / (adapter - base), the metric's sign taken into account; None if
    # the adapter gained nothing on these items
    requantize_from: str
    kept_16bit: list[str]  # linears kept 16-bit (trained so, or kept by size_budget / keep_16bit)
    delta_kept: float  # of the adapter's weight change, the share the merged weights hold (projection, all layers)
    rounding: str = "nearest"  # how the NVFP4 linears were rounded: gptq (on the training items) or nearest

    def describe(self) -> str:
        pct = "%" if self.metric == "accuracy" else ""
        scale = 100 if self.metric == "accuracy" else 1

        def show(value: float) -> str:
            return f"{value * scale:.1f}{pct}" if pct else f"{value:.4f}"

        kept = "n/a (no gain)" if self.gain_kept is None else f"{self.gain_kept:.0%}"
        return (
            f"held-out {self.metric}: base {show(self.base)}, adapter {show(self.adapter)}, merged {show(self.merged)}"
            f" ({kept} of the adapter's gain kept; weight change kept {self.delta_kept:.0%}; "
            f"from {self.requantize_from}, {self.rounding} rounding, {len(self.kept_16bit)} linears 16-bit)"
        )


def _original_weights(folder: Path, names: list[str]) -> dict[str, torch.Tensor]:
    """The full-precision weight of each linear in `names` (`original_weights`), as fp32; an OptionError naming
    requantize_from when the base has none."""
    try:
        return {name: tensor.float() for name, tensor in original_weights(folder, names).items()}
    except ValueError as err:
        raise OptionError(
            "requantize_from",
            f"'original' needs the base's full-precision weights, but {err}; pass --requantize_from nvfp4, or "
            "--model with the full-precision checkpoint",
        ) from None


def check_merge_options(
    requantize_from: str, keep_16bit: float, rounding: str = "nearest", size_budget: float = 1.0
) -> None:
    if rounding not in ROUNDINGS:
        raise OptionError("rounding", f"rounding={rounding!r} is not one of {', '.join(ROUNDINGS)}")
    if requantize_from not in REQUANTIZE_FROM:
        choices = ", ".join(REQUANTIZE_FROM)
        raise OptionError("requantize_from", f"requantize_from={requantize_from!r} is not one of {choices}")
    if isinstance(keep_16bit, bool) or not isinstance(keep_16bit, (int, float)) or not 0.0 <= keep_16bit <= 1.0:
        raise OptionError(
            "keep_16bit", f"keep_16bit={keep_16bit!r} is not a fraction; pass a number from 0 to 1, e.g. 0.25"
        )
    if isinstance(size_budget, bool) or not isinstance(size_budget, (int, float)) or not size_budget >= 1.0:
        raise OptionError(
            "size_budget",
            f"size_budget={size_budget!r} is not a size ratio of at least 1 (the all-NVFP4 model's size); pass e.g. "
            "1.3, or 1 to keep no linear 16-bit beyond those trained so",
        )


@torch.no_grad()
def merged_weights(
    pact: PactModelForCausalLM,
    requantize_from: str,
    keep_16bit: float,
    rounding: str = "nearest",
    data: str | None = None,
    size_budget: float = 1.0,
) -> tuple[dict[str, NVFP4Tensor | torch.Tensor], float]:
    """`{linear name: its merged weight}` (NVFP4, or a bf16 tensor for the kept linears) and the share of the
    adapter's weight change the merged weights hold. `rounding="gptq"` rounds each NVFP4 linear with GPTQ, on the
    moments of its inputs over `data`'s training items (`calibration.py`); `size_budget` and `keep_16bit` keep the
    linears it rounds worst bf16 (`kept_16bit`)."""
    check_merge_options(requantize_from, keep_16bit, rounding, size_budget)
    layers = {name.removeprefix("base_model.model."): m for name, m in pact.model.named_modules()}
    layers = {name: m for name, m in layers.items() if isinstance(m, PactLoraLinear)}
    packed = [name for name, m in layers.items() if m.get_base_layer().precision == "nvfp4"]
    hessians = {}
    if rounding == "gptq":
        rows = calibration_rows(pact.tokenizer, data)
        hessians = input_hessians(pact.model, {name: layers[name] for name in packed}, rows)
    originals = _original_weights(Path(pact.base_path), packed) if requantize_from == "original" else {}
    adapter = pact.model.active_adapter
    merged, lost, dots, norm, moved = {}, {}, {}, 0.0, {}

    def held(name: str, weight: NVFP4Tensor | torch.Tensor, trained: torch.Tensor, delta: torch.Tensor) -> None:
        """Record `weight` for `name`: how far its change from the trained base is from the delta, and along it."""
        dense = weight.dequantize(torch.float32) if isinstance(weight, NVFP4Tensor) else weight.float()
        change = dense - trained
        merged[name] = weight
        lost[name], dots[name] = float((change - delta).pow(2).sum()), float((change * delta).sum())

    # a bar over the rounding: at 1.5B parameters it is minutes (GPTQ's factorizations for the 8960-input layers)
    for name, layer in tqdm(layers.items(), desc="rounding the merge", unit="linear", leave=False):
        base = layer.get_base_layer()
        trained = base.dequantize(torch.float32)  # the base the adapter was trained against
        delta = layer.get_delta_weight(adapter).float()
        norm += float(delta.pow(2).sum())
        if base.precision != "nvfp4":  # trained 16-bit: stays 16-bit, the change merged exactly
            held(name, trained + delta, trained, delta)
            continue
        target = originals.pop(name, trained) + delta
        held(name, gptq_quantize(target, hessians[name]) if name in hessians else quantize(target), trained, delta)
        error = merged[name].dequantize(torch.float32) - target
        moved[name] = float((error @ hessians[name] * error).sum()) if name in hessians else lost[name]
    for name in linears_kept_16bit(pact.model, layers, moved, keep_16bit, size_budget):
        layer = layers[name]
        trained = layer.get_base_layer().dequantize(torch.float32)
        delta = layer.get_delta_weight(adapter).float()
        held(name, (trained + delta).to(torch.bfloat16), trained, delta)
    return merged, sum(dots.values()) / norm if norm else 1.0


def linears_kept_16bit(
    model, layers: dict, moved: dict[str, float], keep_16bit: float, size_budget: float
) -> list[str]:
    """The NVFP4 linears (`moved`: how far each one's rounding moves what it computes) to keep bf16: the worst
    `keep_16bit` fraction of all linears, and the worst that fit while the weights stay within `size_budget` times
    their all-NVFP4 size (NVFP4: 4.5 bits a weight with its e4m3 block scales; the rest 16-bit)."""
    numel = {name: layer.in_features * layer.out_features for name, layer in layers.items()}
    frozen = {id(p) for m in model.modules() if isinstance(m, FrozenLinear) for p in m.parameters()}
    rest = sum(p.numel() for n, p in model.named_parameters() if "lora_" not in n and id(p) not in frozen)
    packed_bytes = 0.5 + 1 / BLOCK_SIZE
    size = 2 * rest + sum(n * (packed_bytes if name in moved else 2) for name, n in numel.items())
    room = size_budget * (2 * rest + packed_bytes * sum(numel.values())) - size
    worst = sorted(moved, key=moved.get, reverse=True)
    keep = set(worst[: round(keep_16bit * len(layers))])
    for name in worst:
        cost = numel[name] * (2 - packed_bytes)
        if name not in keep and cost <= room:
            keep.add(name)
            room -= cost
    return [name for name in worst if name in keep]


def _merged_model(path: str, weights: dict[str, NVFP4Tensor | torch.Tensor], torch_dtype: torch.dtype):
    """The base at `path` on PACT's NVFP4 layers, holding `weights` (`merged_weights`'s) in place of its own."""
    kept = [name for name, weight in weights.items() if not isinstance(weight, NVFP4Tensor)]
    if len(kept) == len(weights):  # every linear 16-bit (a small model under the size budget): a plain model
        quantization = None
    else:
        quantization = PactQuantizationConfig(modules_to_not_convert=kept or None)
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=quantization, dtype=torch_dtype)
    for name, weight in weights.items():
        module = model.get_submodule(name)
        if isinstance(weight, NVFP4Tensor):
            module.load_nvfp4(weight)
        else:
            module.weight.data.copy_(weight)
    return model


def modelopt_config(model) -> dict:
    """ModelOpt's `hf_quant_config.json` for a model on PACT's NVFP4 layers: weight-only NVFP4 (W4A16_NVFP4, blocks
    of 16) with every linear left 16-bit (the output head, the kept ones, the 16-bit `FrozenLinear`s) in
    `exclude_modules`, as vLLM and llama.cpp's converter read it. config.json keeps PACT's own quantization_config, so
    transformers loads the folder as before."""
    excluded = [
        name
        for name, module in model.named_modules()
        if type(module) is torch.nn.Linear or (isinstance(module, FrozenLinear) and module.precision != "nvfp4")
    ]
    return {
        "producer": {"name": "optimum-pact", "version": __version__},
        "quantization": {
            "quant_algo": "W4A16_NVFP4",
            "kv_cache_quant_algo": None,
            "group_size": BLOCK_SIZE,
            "exclude_modules": excluded,
        },
    }


def save_nvfp4_folder(model, tokenizer, folder: Path) -> None:
    """Save a model on PACT's NVFP4 layers and its tokenizer in `folder`, with ModelOpt's hf_quant_config.json."""
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    (folder / "hf_quant_config.json").write_text(json.dumps(modelopt_config(model), indent=2) + "\n")


def save_merged(
    adapter: str | Path,
    output: str | Path,
    base: str | None = None,
    requantize_from: str = "nvfp4",
    keep_16bit: float = 0.0,
    dtype: str = "auto",
    rounding: str = "gptq",
    data: str | None = None,
    size_budget: float = SIZE_BUDGET,
) -> Path:
    """`export_nvfp4_merged`'s folder without its scoring (no report): for a merge made again and again, such as
    the GGUF `pact generate --engine llama.cpp` keeps beside an adapter. Returns `output`."""
    adapter, output = check_paths(adapter, output)
    check_merge_options(requantize_from, keep_16bit, rounding, size_budget)
    pact = PactModelForCausalLM.from_pretrained(base, adapter=str(adapter), dtype=dtype)
    torch_dtype = pact.precisions.dtype
    weights, _ = merged_weights(pact, requantize_from, keep_16bit, rounding, data, size_budget)
    path, tokenizer = pact.base_path, pact.tokenizer
    del pact
    model = _merged_model(path, weights, torch_dtype)
    with written_aside(output) as tmp:
        save_nvfp4_folder(model, tokenizer, tmp)
    return output


def _score(held_out: HeldOut, model) -> float:
    return held_out.measure(model, with_answer=False)[held_out.metric]


def export_nvfp4_merged(
    adapter: str | Path,
    output: str | Path,
    base: str | None = None,
    data: str | None = None,
    requantize_from: str = "nvfp4",
    keep_16bit: float = 0.0,
    dtype: str = "auto",
    rounding: str = "gptq",
    size_budget: float = SIZE_BUDGET,
) -> MergeReport:
    """Merge `adapter` into its NVFP4 base, save the result at `output` (ModelOpt layout, loadable with
    `AutoModelForCausalLM.from_pretrained(output)` once optimum_pact is imported) and report what the merge kept,
    scored on `data`'s held-out items (default: the main job's data). `dtype`: the one the adapter was trained in
    (the NVFP4 base is quantized from the weights in that dtype; "auto": the one the adapter records)."""
    adapter, output = check_paths(adapter, output)
    check_merge_options(requantize_from, keep_16bit, rounding, size_budget)
    pact = PactModelForCausalLM.from_pretrained(base, adapter=str(adapter), dtype=dtype)
    torch_dtype = pact.precisions.dtype
    weights, delta_kept = merged_weights(pact, requantize_from, keep_16bit, rounding, data, size_budget)
    kept = [name for name, weight in weights.items() if not isinstance(weight, NVFP4Tensor)]
    form, train, heldout = load_data(data)
    tokenizer = pact.tokenizer
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    collator = DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=-100)
    held_out = HeldOut(form, tokenizer, train, heldout, collator)
    with pact.model.disable_adapter():
        base_score = _score(held_out, pact.model)
    adapter_score = _score(held_out, pact.model)
    path = pact.base_path
    del pact

    model = _merged_model(path, weights, torch_dtype)
    with written_aside(output) as tmp:  # written, reloaded and scored aside, then renamed
        save_nvfp4_folder(model, tokenizer, tmp)
        del model
        merged_score = _score(held_out, AutoModelForCausalLM.from_pretrained(tmp, dtype=torch_dtype))
        sign = 1.0 if held_out.metric == "accuracy" else -1.0
        gain = sign * (adapter_score - base_score)
        report = MergeReport(
            metric=held_out.metric,
            base=base_score,
            adapter=adapter_score,
            merged=merged_score,
            gain_kept=sign * (merged_score - base_score) / gain if gain > 0 else None,
            requantize_from=requantize_from,
            kept_16bit=kept,
            delta_kept=delta_kept,
            rounding=rounding,
        )
        (tmp / "merge_report.json").write_text(json.dumps(asdict(report), indent=2) + "\n")
    if report.gain_kept is not None and report.gain_kept < WARN_BELOW:
        logger.warning(
            "the NVFP4 merge kept %.0f%% of the adapter's gain (%s). Keep the linears that lose most 16-bit "
            "(a --size_budget above 1.3, or --keep_16bit 0.25), or use the adapter unmerged (pact generate "
            "--adapter) or as a llama.cpp LoRA (--format gguf-lora).",
            100 * report.gain_kept,
            report.describe(),
        )
    return report


__all__ = [
    "MergeReport",
    "REQUANTIZE_FROM",
    "SIZE_BUDGET",
    "export_nvfp4_merged",
    "merged_weights",
    "modelopt_config",
    "save_merged",
    "save_nvfp4_folder",
]
