"""`pact export`: a trained adapter in a form other tools load.

    pact export --adapter my-run/adapter --format merged-bf16 --output my-model

`merged-bf16`: a plain transformers folder (safetensors + tokenizer) whose weights are the base the adapter was
trained on (NVFP4 dequantized, its 16-bit linears as they were), with the adapter merged in by peft's
`merge_and_unload`: what the adapter computed in training, loadable by `AutoModelForCausalLM.from_pretrained`
anywhere.

`gguf-lora`: the adapter alone as a llama.cpp LoRA GGUF, for the base GGUF a phone already has (`gguf_lora.py`);
`--base-gguf` checks first that a GGUF is that base.

`nvfp4-merged`: base + adapter merged and re-quantized to NVFP4 in the ModelOpt layout, scored before it is kept:
the held-out accuracy of the base, the adapter and the merged folder as reloaded, with a warning when the merge
keeps less than 80% of the adapter's gain (`nvfp4_merge.py`; `--rounding`, `--requantize_from`, `--keep_16bit`).

`gguf`: that merged NVFP4 model as one llama.cpp GGUF, its linears in llama.cpp's own NVFP4 (`gguf_export.py`;
`--embeddings`, `--no-merge`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel

from ..quantizer import PactQuantizationConfig
from .gguf_export import EMBEDDINGS, export_gguf
from .gguf_lora import export_gguf_lora
from .model_folder import adapter_loading, check_paths, load_causal_lm, load_tokenizer, resolve_model, written_aside
from .modeling import read_adapter_config, trained_base
from .nvfp4_merge import REQUANTIZE_FROM, ROUNDINGS, SIZE_BUDGET, export_nvfp4_merged
from .rounded_base import apply_adapter_codes

FORMATS = ("merged-bf16", "gguf-lora", "nvfp4-merged", "gguf")


@dataclass
class ExportArguments:
    adapter: str = field(metadata={"help": "The adapter folder to export (e.g. pact-output/adapter)."})
    output: str = field(
        metadata={"help": "Where the exported model goes (a new folder; gguf-lora and gguf: a new file)."}
    )
    format: str = field(default="merged-bf16", metadata={"help": "What to write.", "choices": list(FORMATS)})
    model: str | None = field(
        default=None, metadata={"help": "The base the adapter was trained on (default: SmolLM2, the main job's)."}
    )
    base_gguf: str | None = field(
        default=None, metadata={"help": "gguf-lora: a GGUF of that base to check the adapter against first."}
    )
    data: str | None = field(
        default=None,
        metadata={
            "help": "nvfp4-merged, gguf: the data whose held-out items score the merge (default: the main job's)."
        },
    )
    requantize_from: str = field(
        default="nvfp4",
        metadata={
            "help": "nvfp4-merged, gguf: what the merge rounds to NVFP4: the weights the adapter was trained against "
            "+ its change ('nvfp4', the model it was scored as) or the full-precision checkpoint + the change "
            "('original').",
            "choices": list(REQUANTIZE_FROM),
        },
    )
    size_budget: float = field(
        default=SIZE_BUDGET,
        metadata={
            "help": "nvfp4-merged, gguf: the merged model's size at most, as a multiple of its all-NVFP4 size; within "
            "it the linears whose rounding moves their outputs most stay bf16 (1: none beyond those trained 16-bit)."
        },
    )
    keep_16bit: float = field(
        default=0.0,
        metadata={"help": "nvfp4-merged, gguf: a fraction of linears to keep bf16 as well, those rounded worst."},
    )
    rounding: str = field(
        default="gptq",
        metadata={
            "help": "nvfp4-merged, gguf: how the merged weights are rounded to NVFP4: gptq (each rounding error "
            "compensated on the layer's inputs over --data's training items) or nearest.",
            "choices": list(ROUNDINGS),
        },
    )
    embeddings: str = field(
        default="auto",
        metadata={
            "help": "gguf: the type of the embeddings, the output head and any 16-bit linear: auto (the output head "
            "q8_0, a separate token embedding q4_1, 16-bit linears q8_0: each by its role, as Q4_K_M files do), or "
            "f16, q8_0 (half of f16's size), f32 for all three.",
            "choices": list(EMBEDDINGS),
        },
    )
    no_merge: bool = field(
        default=False,
        metadata={"help": "gguf: write the NVFP4 base the adapter was trained on, without the adapter."},
    )


def export_merged(adapter: str | Path, output: str | Path, base: str | None = None, dtype=torch.bfloat16) -> Path:
    """Write base (NVFP4, dequantized) + adapter merged as a plain transformers folder at `output`; returns it."""
    adapter, output = check_paths(adapter, output)
    path = resolve_model(base, adapter)
    trained_dtype, dense = trained_base(read_adapter_config(adapter), path, unrecorded=dtype)  # as it was trained
    quantization = PactQuantizationConfig(modules_in_16bit=dense or None)
    model = load_causal_lm(path, base, quantization_config=quantization, dtype=trained_dtype)
    apply_adapter_codes(model, adapter)  # the adapter's own rounding of the base, if it was trained on one
    model = model.dequantize(dtype=dtype).to(dtype)  # the effective weights the adapter was trained against
    tokenizer = load_tokenizer(path, base)
    with adapter_loading(adapter, path):
        config = LoraConfig.from_pretrained(str(adapter))
        merged = PeftModel.from_pretrained(model, str(adapter), config=config).merge_and_unload()
    size = sum(p.numel() * p.element_size() for p in merged.parameters())
    with written_aside(output, needs=size) as tmp:
        merged.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    return output


def export(args: ExportArguments) -> Path:
    if args.format not in FORMATS:
        raise ValueError(f"--format {args.format!r} is not one of {', '.join(FORMATS)}")
    if args.format != "gguf" and (args.no_merge or args.embeddings != "auto"):
        given = "--no-merge" if args.no_merge else f"--embeddings {args.embeddings}"
        raise ValueError(f"{given} is for --format gguf, not {args.format!r}")
    if args.format == "gguf-lora":
        return export_gguf_lora(args.adapter, args.output, args.model, args.base_gguf)
    if args.base_gguf is not None:
        raise ValueError(f"--base-gguf is for --format gguf-lora, not {args.format!r}")
    if args.format == "gguf":
        return export_gguf(
            args.adapter, args.output, args.model, args.embeddings, not args.no_merge, args.data,
            args.requantize_from, args.keep_16bit, rounding=args.rounding, size_budget=args.size_budget,
        )  # fmt: skip
    if args.format == "nvfp4-merged":
        report = export_nvfp4_merged(
            args.adapter, args.output, args.model, args.data, args.requantize_from, args.keep_16bit,
            rounding=args.rounding, size_budget=args.size_budget,
        )  # fmt: skip
        print(report.describe())
        return Path(args.output)
    return export_merged(args.adapter, args.output, args.model)


__all__ = ["FORMATS", "ExportArguments", "export", "export_merged"]
