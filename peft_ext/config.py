"""PactConfig: a drop-in for peft's LoraConfig whose targeted linears train on an NVFP4 data-flow base."""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from peft import LoraConfig
from torch import nn

from optimum_pact.backends import BACKENDS
from optimum_pact.dataflow import FrozenLinear

from .layer import dispatch_pact

PACT_CONFIG_NAME = "pact_config.json"


@dataclass
class PactConfig(LoraConfig):
    """`LoraConfig` plus PACT's fields. `peft_type` stays LORA, so adapters are plain PEFT files.

    `get_peft_model(model, PactConfig(...))` quantizes the frozen weight of every targeted linear to NVFP4
    (`FrozenLinear`) and wraps it with LoRA. `save_pretrained` writes a plain `adapter_config.json` (loadable by
    stock peft on the unquantized base) and the PACT fields to `pact_config.json` beside it.
    """

    backend: str = field(
        default="torch", metadata={"help": f"Backend for the frozen-weight products: one of {', '.join(BACKENDS)}."}
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
        if self.backend not in BACKENDS:
            raise ValueError(
                f"PactConfig.backend={self.backend!r} is not a known backend; choose one of {', '.join(BACKENDS)}."
            )
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

    @classmethod
    def pact_field_names(cls) -> tuple[str, ...]:
        lora = {f.name for f in dataclasses.fields(LoraConfig)}
        return tuple(f.name for f in dataclasses.fields(cls) if f.name not in lora)

    def pact_dict(self) -> dict:
        """The PACT fields, as written to `pact_config.json`."""
        return {name: getattr(self, name) for name in self.pact_field_names()}

    def to_dict(self) -> dict:
        """The LoRA fields only: `adapter_config.json` stays the plain PEFT format."""
        out = super().to_dict()
        for name in self.pact_field_names():
            out.pop(name, None)
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
        return cls(**values)
