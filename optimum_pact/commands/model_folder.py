"""Which model folder a command loads: the embedded default model, a local folder checked to hold a causal LM, or
a Hub id. Shared by `pact finetune`, `pact generate` / `pact chat` and `pact export`."""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import transformers
from transformers import AutoConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_FOR_MASKED_LM_MAPPING_NAMES

from ..files import read_json_object
from .default_model import ensure_default_model


def resolve_model(model: str | None) -> str:
    """The local folder (or Hub id) to load; the embedded default model when `model` is None.

    A local folder must hold a config.json that transformers reads as a causal language model (`check_model_folder`).
    """
    if model is None:
        return str(ensure_default_model())
    path = Path(model).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"--model {model!r}: {path} has no config.json; pass a folder written by save_pretrained."
            )
        check_model_folder(path, model)
        return str(path)
    if model.startswith((".", "/", "~")) or not re.fullmatch(r"[\w.-]+/[\w.-]+", model):
        raise FileNotFoundError(f"--model {model!r} does not exist; pass an existing model folder or a Hub id.")
    return model  # a Hub id such as "HuggingFaceTB/SmolLM2-135M-Instruct"


def check_model_folder(path: Path, given: str) -> None:
    """Raise ValueError, naming `path/config.json` and what to pass instead, unless AutoModelForCausalLM can load
    the folder: config.json empty or not JSON, no model_type, a model_type this transformers does not know or that
    is not a causal LM (transformers' own `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`), or masked-LM weights (e.g. BERT's,
    which AutoModelForCausalLM would load as a bidirectional BertLMHeadModel)."""
    config_file = path / "config.json"
    where = f"--model {given!r}: {config_file}"
    instead = (
        "pass the folder of a causal language model written by save_pretrained (such as SmolLM2, Llama or Qwen2), "
        "or leave out --model to fine-tune the default model"
    )
    raw = read_json_object(config_file, f"copy the model folder again, or {instead}.", label=where)
    try:
        config = AutoConfig.from_pretrained(str(path))
    except (OSError, ValueError, KeyError):
        if "model_type" not in raw:
            raise ValueError(
                f"{where} has no model_type, so transformers cannot tell which model it describes; {instead}."
            ) from None
        raise ValueError(
            f"{where} has model_type {raw['model_type']!r}, which transformers {transformers.__version__} does not "
            f"know; upgrade transformers if it is a newer model, or {instead}."
        ) from None
    model_type = config.model_type
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ValueError(
            f"{where} has model_type {model_type!r}, which AutoModelForCausalLM cannot load: it is not a causal "
            f"language model, and PACT fine-tunes one to generate a label; {instead}."
        )
    causal = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]
    causal = {causal} if isinstance(causal, str) else set(causal)
    masked = MODEL_FOR_MASKED_LM_MAPPING_NAMES.get(model_type)
    masked = {masked} if isinstance(masked, str) else set(masked or ())
    architectures = set(getattr(config, "architectures", None) or ())
    if architectures and architectures <= masked and not architectures & causal:
        raise ValueError(
            f"{where} describes a {', '.join(sorted(architectures))}: a masked language model (an encoder that sees "
            f"the whole text), not a causal language model, although AutoModelForCausalLM would load it as a "
            f"{', '.join(sorted(causal))}; {instead}."
        )


def check_adapter_folder(adapter: str | Path) -> Path:
    """`adapter` as a Path, if it is an adapter folder (it holds adapter_config.json)."""
    adapter = Path(adapter)
    if not (adapter / "adapter_config.json").is_file():
        raise FileNotFoundError(
            f"--adapter {str(adapter)!r} has no adapter_config.json; pass the adapter folder of a run"
        )
    return adapter


def check_paths(adapter: str | Path, output: str | Path) -> tuple[Path, Path]:
    """`adapter` must be an adapter folder and `output` a new (or empty) folder; both as Paths."""
    adapter, output = check_adapter_folder(adapter), Path(output)
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        raise FileExistsError(f"--output {str(output)!r} exists and is not empty; pass a new folder")
    return adapter, output


@contextmanager
def written_aside(output: Path) -> Iterator[Path]:
    """A new folder beside `output` to write into, renamed to `output` when the block succeeds and removed when it
    fails: a failed export leaves no half-written folder at `output`. It gets the permissions a plain mkdir would
    (a temporary folder is private)."""
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=output.parent, prefix=f".{output.name}-partial-"))
    try:
        yield tmp
        umask = os.umask(0)
        os.umask(umask)
        tmp.chmod(0o777 & ~umask)
        if output.exists():
            output.rmdir()  # an empty folder the user made for it
        os.replace(tmp, output)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


__all__ = ["check_adapter_folder", "check_model_folder", "check_paths", "resolve_model", "written_aside"]
