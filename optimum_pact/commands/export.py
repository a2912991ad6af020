"""`pact export`: a trained adapter in a form other tools load.

    pact export --adapter my-run/adapter --format merged-bf16 --output my-model

`merged-bf16`: a plain transformers folder (safetensors + tokenizer) whose weights are the NVFP4 base the adapter was
trained on, dequantized, with the adapter merged in by peft's `merge_and_unload`: what the adapter computed in
training, loadable by `AutoModelForCausalLM.from_pretrained` anywhere. (The llama.cpp LoRA GGUF and a re-quantized
NVFP4 merge are still to come.)
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

from ..quantizer import PactQuantizationConfig
from .model_folder import resolve_model

FORMATS = ("merged-bf16",)


@dataclass
class ExportArguments:
    adapter: str = field(metadata={"help": "The adapter folder to export (e.g. pact-output/adapter)."})
    output: str = field(metadata={"help": "Where the exported model goes (a new folder)."})
    format: str = field(default="merged-bf16", metadata={"help": "What to write.", "choices": list(FORMATS)})
    model: str | None = field(
        default=None, metadata={"help": "The base the adapter was trained on (default: SmolLM2, the main job's)."}
    )


def export_merged(adapter: str | Path, output: str | Path, base: str | None = None, dtype=torch.bfloat16) -> Path:
    """Write base (NVFP4, dequantized) + adapter merged as a plain transformers folder at `output`; returns it."""
    adapter, output = Path(adapter), Path(output)
    if not (adapter / "adapter_config.json").is_file():
        raise FileNotFoundError(
            f"--adapter {str(adapter)!r} has no adapter_config.json; pass the adapter folder of a run"
        )
    if output.exists() and any(output.iterdir()):
        raise FileExistsError(f"--output {str(output)!r} exists and is not empty; pass a new folder")
    path = resolve_model(base)
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=PactQuantizationConfig(), dtype=dtype)
    model = model.dequantize(dtype=dtype)  # the effective weights the adapter was trained against
    config = LoraConfig.from_pretrained(str(adapter))
    merged = PeftModel.from_pretrained(model, str(adapter), config=config).merge_and_unload()
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=output.parent, prefix=f".{output.name}-partial-"))
    try:  # written aside and renamed: a failed export leaves no half-written folder at `output`
        merged.save_pretrained(tmp)
        AutoTokenizer.from_pretrained(path).save_pretrained(tmp)
        if output.exists():
            output.rmdir()
        os.replace(tmp, output)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return output


def export(args: ExportArguments) -> Path:
    if args.format not in FORMATS:
        raise ValueError(f"--format {args.format!r} is not one of {', '.join(FORMATS)}")
    return export_merged(args.adapter, args.output, args.model)


__all__ = ["FORMATS", "ExportArguments", "export", "export_merged"]
