"""PactConfig: a drop-in for peft's LoraConfig whose targeted linears train on an NVFP4 data-flow base."""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from peft import LoraConfig
from torch import nn

from optimum_pact.backends import BACKEND_CHOICES
from optimum_pact.dataflow import FrozenLinear
from optimum_pact.precision.plan import PRECISIONS, check_plan

from .layer import dispatch_pact
from .protection import check_protect_fraction, check_rank_by

PACT_CONFIG_NAME = "pact_config.json"
ADAPT_CHOICES = ("quality", "speed")


@dataclass
class PactConfig(LoraConfig):
    """`LoraConfig` plus PACT's fields. `peft_type` stays LORA, so adapters are plain PEFT files.

    `get_peft_model(model, PactConfig(...))` quantizes the frozen weight of every targeted linear to NVFP4
    (`FrozenLinear`) and wraps it with LoRA. `save_pretrained` writes a plain `adapter_config.json` (loadable by
    stock peft on the unquantized base) and the PACT fields to `pact_config.json` beside it.
    """

    backend: str = field(
        default="torch",
        metadata={
            "help": f"Backend for the frozen-weight products: one of {', '.join(BACKEND_CHOICES)} ('auto' takes qnn "
            "where a real QNN HTP starts, else torch)."
        },
    )
    backend_options: dict | None = field(
        default=None,
        metadata={"help": "Keyword options of the backend, e.g. {'soc_model': '69'} for qnn (its Snapdragon SoC id)."},
    )
    overlap: bool | None = field(
        default=None,
        metadata={
            "help": "Run the adapter path on the CPU while the backend computes the frozen product. None: on for "
            "backends other than torch (on the torch backend both would share the same cores)."
        },
    )
    precision_plan: dict[str, str] | None = field(
        default=None,
        metadata={
            "help": f"Per-layer precision, module name -> one of {', '.join(PRECISIONS)} (absent: nvfp4). Made by "
            "`PactConfig.with_precision_plan` from the gradient-sensitivity probe; saved in pact_config.json."
        },
    )
    precision_budget_mib: float | None = field(
        default=None, metadata={"help": "The memory budget (MiB above all-NVFP4) the precision plan was made under."}
    )
    protect_fraction: float = field(
        default=0.0,
        metadata={
            "help": "AQLoRA: the fraction of targeted linears with the largest 4-bit reconstruction error kept 16-bit "
            "(no dequantization), e.g. 0.2. 0 protects none."
        },
    )
    rank_by: str = field(
        default="nvfp4", metadata={"help": "AQLoRA ranking format: 'nvfp4' (PACT's base) or 'nf4' (bitsandbytes)."}
    )
    adapt: str = field(
        default="quality",
        metadata={
            "help": "'quality' adapts every targeted linear; 'speed' only those in the top adapt_top_blocks blocks, "
            "so the backward pass stops below them."
        },
    )
    adapt_top_blocks: int | None = field(
        default=None, metadata={"help": "adapt='speed': how many top blocks get adapters (None: the top half)."}
    )
    protected_modules: list[str] | None = field(
        default=None,
        metadata={"help": "The linears AQLoRA kept 16-bit (written by get_peft_model; reused when given)."},
    )
    tile_size: int | None = field(
        default=None,
        metadata={
            "help": "Weight rows (forward) / columns (input gradient) dequantized at a time, a multiple of 16. "
            "None uses the backend's default."
        },
    )

    def __post_init__(self):
        super().__post_init__()
        if self.backend not in BACKEND_CHOICES:
            raise ValueError(
                f"PactConfig.backend={self.backend!r} is not a known backend; "
                f"choose one of {', '.join(BACKEND_CHOICES)}."
            )
        if self.backend_options is not None and (
            not isinstance(self.backend_options, dict) or not all(isinstance(k, str) for k in self.backend_options)
        ):
            raise ValueError(
                f"PactConfig.backend_options={self.backend_options!r} must be a dict of option name -> value, "
                "e.g. {'soc_model': '69'}, or None."
            )
        check_plan(self.precision_plan, "PactConfig.precision_plan")
        check_protect_fraction(self.protect_fraction, "PactConfig.protect_fraction")
        check_rank_by(self.rank_by, "PactConfig.rank_by")
        if self.adapt not in ADAPT_CHOICES:
            raise ValueError(f"PactConfig.adapt={self.adapt!r} must be one of {', '.join(map(repr, ADAPT_CHOICES))}.")
        if self.adapt_top_blocks is not None and (
            isinstance(self.adapt_top_blocks, bool) or not isinstance(self.adapt_top_blocks, int)
            or self.adapt_top_blocks < 1
        ):  # fmt: skip
            raise ValueError(
                f"PactConfig.adapt_top_blocks={self.adapt_top_blocks!r} must be a positive number of blocks or None."
            )
        if self.adapt_top_blocks is not None and self.adapt != "speed":
            raise ValueError(
                f"PactConfig.adapt_top_blocks={self.adapt_top_blocks} applies to adapt='speed'; set adapt='speed' "
                "or drop adapt_top_blocks."
            )
        if self.overlap not in (None, True, False):
            raise ValueError(f"PactConfig.overlap={self.overlap!r} must be True, False or None (backend default).")
        if self.tile_size is not None and (
            isinstance(self.tile_size, bool) or not isinstance(self.tile_size, int) or self.tile_size <= 0
        ):
            raise ValueError(f"PactConfig.tile_size={self.tile_size!r} must be None or a positive multiple of 16.")
        if self.tile_size is not None and self.tile_size % 16:
            raise ValueError(
                f"PactConfig.tile_size={self.tile_size} must be a multiple of 16 (NVFP4 block size); "
                f"try {max(16, self.tile_size // 16 * 16)}."
            )
        # peft's documented hook for custom LoRA layers (`LoraConfig._register_custom_module`, private):
        # every targeted nn.Linear / FrozenLinear goes through `dispatch_pact`. Tested in tests/test_peft_ext.py.
        self._register_custom_module({nn.Linear: dispatch_pact, FrozenLinear: dispatch_pact})

    def with_precision_plan(self, model: nn.Module, batch: dict, budget_mib: float, **probe_options) -> PactConfig:
        """A copy of this config with a precision plan measured on `model` (unquantized) and a calibration `batch`.

        Runs the gradient-sensitivity probe (`peft_ext.precision.probe_precision`) and keeps in fp16 the layers
        whose NVFP4 weights move the adapter gradients most, as long as the extra memory stays within
        `budget_mib`. `model` is returned to its original state.
        """
        from optimum_pact.precision import plan_precision

        from .precision import probe_precision

        sensitivities = probe_precision(model, batch, self, **probe_options)
        plan = plan_precision(sensitivities, budget_mib)
        return dataclasses.replace(self, precision_plan=plan, precision_budget_mib=budget_mib)

    @classmethod
    def pact_field_names(cls) -> tuple[str, ...]:
        lora = {f.name for f in dataclasses.fields(LoraConfig)}
        return tuple(f.name for f in dataclasses.fields(cls) if f.name not in lora)

    def pact_dict(self) -> dict:
        """The PACT fields, as written to `pact_config.json`."""
        return {name: getattr(self, name) for name in self.pact_field_names()}

    def to_dict(self) -> dict:
        """The LoRA fields only: `adapter_config.json` stays the plain PEFT format.

        With adapt="speed" after `get_peft_model`, `layers_to_transform` / `layers_pattern` name the adapted blocks,
        so stock peft puts adapters exactly where they were trained.
        """
        out = super().to_dict()
        for name in self.pact_field_names():
            out.pop(name, None)
        out.pop("_pact_pending", None)
        speed = self.__dict__.get("_pact_speed_blocks")
        if speed is not None:
            out["layers_pattern"], out["layers_to_transform"] = speed
        return out

    def save_pretrained(self, save_directory: str, **kwargs) -> None:
        super().save_pretrained(save_directory, **kwargs)
        target = Path(save_directory) / PACT_CONFIG_NAME
        tmp = target.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.pact_dict(), indent=2, sort_keys=True) + "\n")
        os.replace(tmp, target)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str, subfolder: str | None = None, **kwargs) -> PactConfig:
        """Read `adapter_config.json` and the `pact_config.json` sidecar (PACT defaults where it is absent)."""
        lora = LoraConfig.from_pretrained(pretrained_model_name_or_path, subfolder=subfolder, **kwargs)
        init_fields = {f.name for f in dataclasses.fields(LoraConfig) if f.init}
        values = {k: v for k, v in lora.__dict__.items() if k in init_fields}
        sidecar = Path(pretrained_model_name_or_path, subfolder or "", PACT_CONFIG_NAME)
        if sidecar.is_file():
            pact = json.loads(sidecar.read_text())
            unknown = set(pact) - set(cls.pact_field_names())
            if unknown:
                raise ValueError(
                    f"{sidecar} has fields this version of optimum-pact does not know: {sorted(unknown)}. "
                    "Upgrade optimum-pact or remove them."
                )
            values.update(pact)
            if pact.get("adapt") == "speed":  # PACT derives the adapted blocks itself, quantizing the ones below
                values["layers_to_transform"], values["layers_pattern"] = None, None
        return cls(**values)
