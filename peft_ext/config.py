"""PactConfig: a drop-in for peft's LoraConfig whose targeted linears train on an NVFP4 data-flow base."""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from peft import LoraConfig
from peft.utils import CONFIG_NAME
from torch import nn

from optimum_pact.backends import Backend, get_backend
from optimum_pact.dataflow import FrozenLinear
from optimum_pact.errors import OptionError
from optimum_pact.files import read_json_object
from optimum_pact.precision.plan import PRECISIONS, check_plan, sixteen_bit_modules

from .layer import dispatch_pact
from .options import PactOptions

PACT_CONFIG_NAME = "pact_config.json"


class _SharedBackend:
    """The backend of the model a config builds. peft deep-copies configs; every copy shares this one holder."""

    def __init__(self):
        self.backend: Backend | None = None

    def __deepcopy__(self, memo):
        return self


@dataclass
class PactConfig(LoraConfig, PactOptions):
    """`LoraConfig` plus PACT's options (`PactOptions`). `peft_type` stays LORA, so adapters are plain PEFT files.

    `get_peft_model(model, PactConfig(...))` quantizes the frozen weight of every targeted linear to NVFP4
    (`FrozenLinear`) and wraps it with LoRA; all of them share ONE backend, `config.get_backend()`. `save_pretrained`
    writes a plain `adapter_config.json` (loadable by stock peft on the unquantized base) and the PACT fields to
    `pact_config.json` beside it.
    """

    precision_plan: dict[str, str] | None = field(
        default=None,
        metadata={
            "help": f"Per-layer precision, module name -> one of {', '.join(PRECISIONS)} (absent: nvfp4). Made by "
            "`PactConfig.with_precision_plan` from the gradient-sensitivity probe; saved in pact_config.json."
        },
    )
    protected_modules: list[str] | None = field(
        default=None,
        metadata={"help": "The linears AQLoRA kept 16-bit (written by get_peft_model; reused when given)."},
    )
    base_dtype: str | None = field(
        default=None,
        metadata={
            "help": "The dtype of the base weights the frozen linears were built from (written by get_peft_model): "
            "the NVFP4 codes and the 16-bit linears depend on it, so the adapter's users load the base in it."
        },
    )

    def __post_init__(self):
        LoraConfig.__post_init__(self)
        PactOptions.__post_init__(self)
        self.__dict__["_pact_backend"] = _SharedBackend()  # before peft copies the config: every copy shares it
        check_plan(self.precision_plan, "PactConfig.precision_plan")
        # peft's documented hook for custom LoRA layers (`LoraConfig._register_custom_module`, private):
        # every targeted nn.Linear / FrozenLinear goes through `dispatch_pact`. Tested in tests/test_peft_ext.py.
        self._register_custom_module({nn.Linear: dispatch_pact, FrozenLinear: dispatch_pact})

    def sixteen_bit_modules(self) -> list[str]:
        """The targeted linears this adapter was trained with 16-bit (AQLoRA's protected ones, the precision plan's
        fp16 ones): every use of the adapter holds them 16-bit too, from the original weights."""
        return sixteen_bit_modules(self.precision_plan, self.protected_modules)

    def get_backend(self) -> Backend:
        """The one backend instance of the model this config builds, made on first use and then shared by every
        layer (`backend="auto"` is resolved here, once; why it chose what it did is `get_backend().reason`)."""
        holder = self.__dict__["_pact_backend"]
        if holder.backend is None:
            holder.backend = get_backend(self.backend, **(self.backend_options or {}))
        return holder.backend

    def with_precision_plan(self, model: nn.Module, batch: dict, budget_mib: float, **probe_options) -> PactConfig:
        """A copy of this config with a precision plan measured on `model` (unquantized) and a calibration `batch`.

        Runs the gradient-sensitivity probe (`peft_ext.precision.probe_precision`) and keeps in fp16 the layers
        whose NVFP4 weights move the adapter gradients most, as long as the extra memory stays within
        `budget_mib`. `model` is returned to its original state. (`with_calibration` with this budget.)
        """
        budgeted = self._replace(precision_budget_mib=budget_mib, precision_plan=None)
        return budgeted.with_calibration(model, batch, **probe_options)

    def with_calibration(self, model: nn.Module, batch: dict, **probe_options) -> PactConfig:
        """A copy of this config with what needs a calibration `batch` measured on `model` (unquantized, no adapters).

        One run of the gradient-sensitivity probe (`peft_ext.precision.probe_precision`: per targeted linear, how much
        its NVFP4 weight moves all adapter gradients) serves both users of it: the precision plan of
        `precision_budget_mib` (the most sensitive layers per byte in fp16 within the budget) and, with
        `rank_by="sensitivity"` or `"auto"`, AQLoRA's protected list (the `protect_fraction` most sensitive layers).
        `model` is returned to its original state; a config that uses no batch is returned as it is.
        """
        if not self.uses_calibration:
            return self
        from optimum_pact.precision import plan_precision

        from .precision import probe_precision
        from .ranking import choose_protected

        sensitivities = probe_precision(model, batch, self, **probe_options)
        changes = {}
        if self._plan_pending():
            changes["precision_plan"] = plan_precision(sensitivities, self.precision_budget_mib)
        if self._ranking_pending():
            ranking = [(s.name, s.score) for s in sensitivities]
            changes["protected_modules"] = choose_protected(ranking, self.protect_fraction)
        return self._replace(**changes)

    def _replace(self, **changes) -> PactConfig:
        """`dataclasses.replace` that keeps this config's backend (the same model: the same backend)."""
        copy = dataclasses.replace(self, **changes)
        copy.__dict__["_pact_backend"] = self.__dict__["_pact_backend"]
        return copy

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
    def from_pretrained(
        cls,
        pretrained_model_name_or_path: str,
        subfolder: str | None = None,
        *,
        allow_missing_sidecar: bool = False,
        **kwargs,
    ) -> PactConfig:
        """Read `adapter_config.json` and the `pact_config.json` sidecar beside it (a folder or a Hub repo).

        `PactConfig.save_pretrained` always writes both, so a folder without `pact_config.json` is taken as a PACT
        adapter that lost it (a partial copy or upload) and raises FileNotFoundError: loading it with PACT's
        defaults would silently drop its precision plan, AQLoRA's protected modules and speed blocks, and its
        backend. To load a plain peft LoRA adapter (trained without PACT) with PACT's defaults, pass
        `allow_missing_sidecar=True`. A damaged (empty, truncated, non-object) `adapter_config.json` or
        `pact_config.json` raises ValueError naming the file. `kwargs` go to `LoraConfig.from_pretrained` (Hub
        options such as `revision`, `token`, `cache_dir`).
        """
        folder = Path(pretrained_model_name_or_path, subfolder or "")
        local = folder.is_dir()
        if (folder / CONFIG_NAME).is_file():
            _read_json_object(folder / CONFIG_NAME)  # damage named here; peft would say only "Expecting value"
        lora = LoraConfig.from_pretrained(pretrained_model_name_or_path, subfolder=subfolder, **kwargs)
        init_fields = {f.name for f in dataclasses.fields(LoraConfig) if f.init}
        values = {k: v for k, v in lora.__dict__.items() if k in init_fields}
        if local:
            sidecar = folder / PACT_CONFIG_NAME
        else:
            sidecar = _download_sidecar(pretrained_model_name_or_path, subfolder, kwargs, allow_missing_sidecar)
        if sidecar is None or not sidecar.is_file():
            if allow_missing_sidecar:
                return cls(**values)
            where = (
                folder
                if local
                else f"Hub repo {pretrained_model_name_or_path!r}" + (f" ({subfolder})" if subfolder else "")
            )
            raise FileNotFoundError(
                f"{where} has {CONFIG_NAME} but no {PACT_CONFIG_NAME}, the PACT settings PactConfig.save_pretrained "
                "writes beside it (precision plan, AQLoRA protected modules and speed blocks, backend). Copy "
                f"{PACT_CONFIG_NAME} from the folder the adapter was saved to; to load a plain peft LoRA adapter "
                "with PACT's defaults, pass allow_missing_sidecar=True."
            )
        pact = _read_json_object(sidecar)
        tile_size = pact.pop("tile_size", None)  # written by optimum-pact 0.1 as its own field: a torch option now
        if tile_size is not None:
            pact["backend_options"] = {**(pact.get("backend_options") or {}), "tile_size": tile_size}
        unknown = set(pact) - set(cls.pact_field_names())
        if unknown:
            raise ValueError(
                f"{sidecar} has fields this version of optimum-pact does not know: {sorted(unknown)}. "
                "Upgrade optimum-pact or remove them."
            )
        values.update(pact)
        if pact.get("adapt") == "speed":  # PACT derives the adapted blocks itself, quantizing the ones below
            values["layers_to_transform"], values["layers_pattern"] = None, None
        try:
            return cls(**values)
        except OptionError as err:
            raise OptionError(err.option, f"{sidecar}: {err}") from None
        except (TypeError, ValueError) as err:
            raise ValueError(f"{sidecar}: {err}") from None


def _read_json_object(path: Path) -> dict:
    """The JSON object in adapter config file `path`; ValueError naming the file when it is damaged."""
    return read_json_object(
        path, "copy the adapter folder again from where it was saved, or write it again with save_pretrained."
    )


def _download_sidecar(repo_id: str, subfolder: str | None, kwargs: dict, allow_missing: bool) -> Path | None:
    """`pact_config.json` of a Hub adapter, through the Hub cache (None: the repo has none)."""
    import inspect

    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError

    hub_kwargs = {k: v for k, v in kwargs.items() if k in inspect.signature(hf_hub_download).parameters}
    try:
        return Path(hf_hub_download(repo_id, PACT_CONFIG_NAME, subfolder=subfolder, **hub_kwargs))
    except LocalEntryNotFoundError as err:  # offline and not cached: whether the repo has one is unknown
        if allow_missing:
            return None
        raise FileNotFoundError(
            f"{PACT_CONFIG_NAME} of {repo_id!r} is not in the Hub cache and the Hub cannot be reached ({err}); "
            "connect once to download it, or pass allow_missing_sidecar=True for PACT's defaults."
        ) from None
    except EntryNotFoundError:
        return None
