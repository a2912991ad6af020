"""Which model folder a command loads: the embedded default model, a local folder checked to hold a causal LM, or
a Hub id; the adapter folders it reads and the folders it writes. Shared by `pact finetune`, `pact generate` /
`pact chat` and `pact export`: a missing or damaged folder is one error naming it and what to do."""

from __future__ import annotations

import os
import re
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import transformers
from safetensors import SafetensorError, safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_FOR_MASKED_LM_MAPPING_NAMES

from ..errors import NoSpaceError
from ..files import aside_folder, free_bytes, ran_out_of_space, read_json_object, why_unreadable
from .default_model import ensure_default_model, recorded_base
from .named_models import NAMED_MODELS, ensure_named_model, named_model

ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")
RUN_AGAIN = "free space and run the same command again"


def resolve_model(model: str | None, adapter: str | Path | None = None) -> str:
    """The local folder (or Hub id) to load. `model` None: the base `adapter` was trained on where it records a local
    folder, else the embedded default model; a named model (`named_models.NAMED_MODELS`: qwen2.5-coder-1.5b,
    gemma-3-270m, smollm2-135m) is fetched and converted once.

    A local folder must hold a config.json that transformers reads as a causal language model (`check_model_folder`).
    """
    if model is None and (recorded := recorded_base(adapter)) is not None:
        model = recorded  # the base the adapter was trained on, as peft's AutoPeftModelForCausalLM loads it
    if model is None:
        return str(ensure_default_model())
    if (named := named_model(model)) is not None:
        return str(ensure_named_model(named))
    path = Path(model).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"--model {model!r}: {path} has no config.json; pass a folder written by save_pretrained."
            )
        check_model_folder(path, model)
        return str(path)
    if model.startswith((".", "/", "~")) or not re.fullmatch(r"[\w.-]+/[\w.-]+", model):
        raise FileNotFoundError(
            f"--model {model!r} does not exist; pass an existing model folder, a Hub id or one of the named models "
            f"({', '.join(NAMED_MODELS)})."
        )
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


def _first_line(err: BaseException) -> str:
    """The line of `err`'s message that says what went wrong (not a heading such as "Error(s) in loading ...:")."""
    lines = [line.strip() for line in str(err).strip().splitlines() if line.strip()]
    line = next((line for line in lines if not line.endswith(":")), lines[0] if lines else type(err).__name__)
    return line.rstrip(".")


def _model_given(given: str | None) -> str:
    return f"--model {given!r}" if given is not None else "the default model"


def _model_fix(path: str, given: str | None) -> str:
    if given is None:
        return f"delete {path} so that the next command makes it again"
    if Path(path).is_dir():
        return "copy the model folder again, or pass a folder written by save_pretrained"
    return "check the Hub id and the network, or pass a local model folder"


def load_causal_lm(path: str, given: str | None, **kwargs):
    """`AutoModelForCausalLM.from_pretrained(path, **kwargs)`; weights that are missing, cut short or do not fit
    config.json (or a Hub id that cannot be fetched) are a ValueError naming the folder and what to do. `given`:
    the --model value it was resolved from (None: the default model)."""
    try:
        return AutoModelForCausalLM.from_pretrained(path, **kwargs)
    except (OSError, SafetensorError, RuntimeError) as err:
        raise ValueError(
            f"{_model_given(given)}: the weights in {path} could not be loaded ({_first_line(err)}); "
            f"{_model_fix(path, given)}."
        ) from err


def load_tokenizer(path: str, given: str | None):
    """`AutoTokenizer.from_pretrained(path)`; missing or damaged tokenizer files are a ValueError naming the folder
    and what to do (`given` as for `load_causal_lm`)."""
    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, TypeError) as err:  # e.g. no tokenizer files: transformers asks for sentencepiece
        first = _first_line(err)
        detail = "" if first.endswith(":") else f" ({first})"  # transformers' sentencepiece list reads as noise
        fix = (
            "the folder needs the files tokenizer.save_pretrained writes (tokenizer.json, tokenizer_config.json) "
            "next to config.json"
            if Path(path).is_dir()
            else "check the Hub id and the network, or pass a local model folder"
        )
        raise ValueError(
            f"{_model_given(given)}: the tokenizer in {path} could not be loaded{detail}; {fix}."
        ) from err


def original_weights(folder: str | Path, names: list[str]) -> dict[str, torch.Tensor]:
    """The full-precision `<name>.weight` of each linear in `names`, read from the checkpoint's safetensors in
    `folder` as stored (one tensor at a time). A name the checkpoint lacks, or holds packed (a saved NVFP4
    checkpoint), is a ValueError naming it."""
    wanted = {f"{name}.weight": name for name in names}
    found: dict[str, torch.Tensor] = {}
    for file in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as reader:
            for key in reader.keys():
                if key in wanted:
                    found[wanted[key]] = reader.get_tensor(key)
    missing = [name for name in names if name not in found]
    packed = [name for name, tensor in found.items() if tensor.dtype == torch.uint8]
    if missing or packed:
        raise ValueError(
            f"{folder} holds {'no' if missing else 'packed (NVFP4)'} weights for {(missing or packed)[0]}, and this "
            "needs the base's full-precision checkpoint (a folder of safetensors)"
        )
    return found


def check_adapter_folder(adapter: str | Path) -> Path:
    """`adapter` as a Path, if it is an adapter folder that reads back: adapter_config.json holds a JSON object and
    the weights are there and whole. Otherwise FileNotFoundError (missing) or ValueError (damaged), naming the
    file and what to do."""
    adapter = Path(adapter)
    given = f"--adapter {str(adapter)!r}"
    of_a_run = "pass the adapter folder of a run (OUTPUT/adapter of pact finetune)"
    if not adapter.is_dir():
        raise FileNotFoundError(f"{given} {'is not a folder' if adapter.exists() else 'does not exist'}; {of_a_run}")
    weights = next((adapter / name for name in ADAPTER_WEIGHTS if (adapter / name).is_file()), None)
    missing = [] if (adapter / "adapter_config.json").is_file() else ["has no adapter_config.json"]
    missing += [] if weights is not None else ["holds no adapter weights (adapter_model.safetensors)"]
    if missing:
        raise FileNotFoundError(f"{given} {' and '.join(missing)}; {of_a_run}")
    again = f"copy the adapter folder again, or {of_a_run}"
    read_json_object(adapter / "adapter_config.json", again, label=f"{given}: {adapter / 'adapter_config.json'}")
    problem = why_unreadable(weights)
    if problem is not None:
        raise ValueError(f"{given}: {weights} is damaged ({problem}): it was cut short or changed; {again}")
    return adapter


@contextmanager
def adapter_loading(adapter: str | Path, base: str) -> Iterator[None]:
    """Around peft's loading of `adapter` onto `base`: an adapter that does not fit the base (other module names
    or shapes: trained on another model) is a ValueError naming both and what to do."""
    try:
        yield
    except (RuntimeError, ValueError, KeyError, SafetensorError) as err:
        raise ValueError(
            f"--adapter {str(adapter)!r} does not fit the base {base} ({_first_line(err)}); pass --model with the "
            "base it was trained on, or an adapter trained on this base"
        ) from err


def check_paths(adapter: str | Path, output: str | Path) -> tuple[Path, Path]:
    """`adapter` must be an adapter folder and `output` a new (or empty) folder; both as Paths."""
    adapter, output = check_adapter_folder(adapter), Path(output)
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        raise FileExistsError(f"--output {str(output)!r} exists and is not empty; pass a new folder")
    return adapter, output


@contextmanager
def written_aside(
    output: Path, replace: bool = False, needs: int | None = None, fix: str = RUN_AGAIN
) -> Iterator[Path]:
    """A new folder beside `output` to write into, renamed to `output` when the block succeeds and removed when it
    fails: a failed write leaves no half-written folder at `output`. With `replace`, a folder already at `output` is
    swapped out only once the new one is complete. A write that runs out of disk space is a NoSpaceError naming the
    folder, the space needed (`needs` bytes, an estimate; None: unknown) and ending in `fix`. The folder gets the
    permissions a plain mkdir would (a temporary folder is private)."""
    tmp = aside_folder(output.parent, f"{output.name}-partial")
    try:
        try:
            yield tmp
        except Exception as err:
            if not ran_out_of_space(err, output.parent, needs):
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # before the free space is measured, as the message reports it
            raise NoSpaceError(output.parent, output.name, needs, free_bytes(output.parent), fix) from err
        umask = os.umask(0)
        os.umask(umask)
        tmp.chmod(0o777 & ~umask)
        if replace and output.is_dir() and any(output.iterdir()):
            old = output.with_name(f".{output.name}-old-{os.getpid()}-{time.monotonic_ns()}")
            os.replace(output, old)
            try:
                os.replace(tmp, output)
            except OSError:
                os.replace(old, output)
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            if output.exists():
                output.rmdir()  # an empty folder the user made for it
            os.replace(tmp, output)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


__all__ = [
    "adapter_loading",
    "check_adapter_folder",
    "check_model_folder",
    "check_paths",
    "load_causal_lm",
    "load_tokenizer",
    "original_weights",
    "resolve_model",
    "written_aside",
]
