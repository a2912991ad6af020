"""PactOptions: the model-side PACT options, declared and checked once.

`PactConfig` takes its PACT fields from this dataclass, and `pact finetune` parses it with `HfArgumentParser`, so
each option has one name, one default, one help text and one check. A bad value raises `OptionError` naming the
option (the field name), the value and the fix.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

from optimum_pact.backends import BACKEND_CHOICES
from optimum_pact.backends.options import check_backend_choice
from optimum_pact.errors import OptionError

from .ranking import CALIBRATED, RANK_BY, check_protect_fraction, check_rank_by

ADAPT_CHOICES = ("quality", "speed")


@dataclass
class PactOptions:
    """Where the frozen products run and which layers stay 16-bit or get adapters."""

    backend: str = field(
        default="torch",
        metadata={
            "help": "Backend for the frozen-weight products ('auto': qnn where a real QNN HTP starts, else torch).",
            "choices": list(BACKEND_CHOICES),
        },
    )
    backend_options: dict | str | None = field(
        default=None,
        metadata={
            "help": "Keyword options of the backend, a dict or its JSON: torch takes tile_size (weight rows / "
            'columns dequantized at a time, a multiple of 16), qnn soc_model (e.g. {"soc_model": "69"}), '
            "min_tokens, max_tokens, provider_options, cache, cache_dir."
        },
    )
    overlap: bool | None = field(
        default=None,
        metadata={
            "help": "Run the adapter path on the CPU while the backend computes the frozen product. None: on where "
            "the backend runs beside the CPU (qnn), off on torch (both would share the same cores)."
        },
    )
    precision_budget_mib: float | None = field(
        default=None,
        metadata={
            "help": "Probe gradient sensitivity on a calibration batch and keep the most sensitive linears 16-bit "
            "within this many MiB above all-NVFP4 (PactConfig.with_calibration; the plan is saved)."
        },
    )
    protect_fraction: float = field(
        default=0.0,
        metadata={
            "help": "AQLoRA: the fraction of targeted linears with the largest 4-bit reconstruction error kept 16-bit "
            "(no dequantization), e.g. 0.2. 0 protects none."
        },
    )
    rank_by: str = field(
        default="auto",
        metadata={
            "help": "AQLoRA ranking: sensitivity (how much each layer's NVFP4 weight moves the adapter gradients on a "
            "calibration batch: PactConfig.with_calibration; PactTrainer and pact finetune use the first training "
            "batch), nvfp4 or nf4 reconstruction error (the weights alone), or auto: sensitivity where a "
            "calibration batch is at hand, else nvfp4.",
            "choices": RANK_BY,
        },
    )
    adapt: str = field(
        default="quality",
        metadata={
            "help": "AQLoRA: quality adapts every targeted linear; speed only those in the top adapt_top_blocks "
            "blocks, so the backward pass stops below them.",
            "choices": list(ADAPT_CHOICES),
        },
    )
    adapt_top_blocks: int | None = field(
        default=None, metadata={"help": "adapt=speed: how many top blocks get adapters (None: the top half)."}
    )

    def __post_init__(self):
        check_pact_options(self)

    @property
    def needs_calibration(self) -> bool:
        """True while a setting cannot be built without a calibration batch: a precision budget without its plan, or
        AQLoRA's `rank_by="sensitivity"` without its protected list (PactConfig's `precision_plan`,
        `protected_modules`)."""
        return self._plan_pending() or (self._ranking_pending() and self.rank_by == "sensitivity")

    @property
    def uses_calibration(self) -> bool:
        """True when a calibration batch changes what these options build: `needs_calibration`, or `rank_by="auto"`
        without its protected list (sensitivity with a batch, NVFP4 error without). PactTrainer and `pact finetune`
        calibrate whenever this holds (`PactConfig.with_calibration`)."""
        return self._plan_pending() or self._ranking_pending()

    @property
    def calibration_option(self) -> str | None:
        """The option that needs a calibration batch, as `name=value` for error messages (None: none does)."""
        if self._plan_pending():
            return f"precision_budget_mib={self.precision_budget_mib!r}"
        return f"rank_by={self.rank_by!r}" if self.needs_calibration else None

    def _plan_pending(self) -> bool:
        return self.precision_budget_mib is not None and getattr(self, "precision_plan", None) is None

    def _ranking_pending(self) -> bool:
        protected = getattr(self, "protected_modules", None)
        return self.rank_by in CALIBRATED and self.protect_fraction > 0 and protected is None

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))


def check_pact_options(owner, prefix: str = "") -> None:
    """Check the `PactOptions` fields held by `owner` under `prefix + name` (a PactOptions or PactConfig: no prefix;
    PactTrainingArguments: "pact_"), naming each option as `owner` declares it. Turns backend_options given as JSON
    text into a dict."""

    def value(name: str):
        return getattr(owner, prefix + name)

    def fail(name: str, message: str):
        raise OptionError(prefix + name, f"{prefix}{name}={value(name)!r} {message}")

    options = check_backend_choice(value("backend"), value("backend_options"), prefix)
    setattr(owner, prefix + "backend_options", options)
    if value("overlap") not in (None, True, False):
        fail("overlap", "must be True, False or None (the backend's default).")
    budget = value("precision_budget_mib")
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, (int, float)) or not budget >= 0):
        fail("precision_budget_mib", "must be a number of MiB >= 0.")
    check_protect_fraction(value("protect_fraction"), prefix + "protect_fraction")
    check_rank_by(value("rank_by"), prefix + "rank_by")
    if value("adapt") not in ADAPT_CHOICES:
        fail("adapt", f"must be one of {', '.join(map(repr, ADAPT_CHOICES))}.")
    top = value("adapt_top_blocks")
    if top is not None and (isinstance(top, bool) or not isinstance(top, int) or top < 1):
        fail("adapt_top_blocks", "must be a positive number of blocks or None.")
    if top is not None and value("adapt") != "speed":
        fail("adapt_top_blocks", f"applies to {prefix}adapt='speed'; set it or drop {prefix}adapt_top_blocks.")


def derived_options(
    name: str,
    source: type = PactOptions,
    names: Collection[str] | None = None,
    prefix: str = "",
    types: Mapping[str, object] | None = None,
) -> type:
    """A dataclass of `source`'s fields `names` (default: all) renamed `prefix + name`, with their types, defaults
    and help texts, for a dataclass or parser that shows options declared elsewhere (PactTrainingArguments' pact_
    fields, `pact finetune`'s LoRA flags, `pact generate`'s backend flags): one declaration stays one. `types`
    replaces a field's type where the new place needs another (one string on a command line)."""
    hints = typing.get_type_hints(source)
    spec = []
    for f in dataclasses.fields(source):
        if names is not None and f.name not in names:
            continue
        default = (
            {"default": f.default} if f.default is not dataclasses.MISSING else {"default_factory": f.default_factory}
        )
        kind = (types or {}).get(f.name, hints[f.name])
        spec.append((prefix + f.name, kind, field(**default, metadata=dict(f.metadata))))
    return dataclasses.make_dataclass(name, spec)


__all__ = ["ADAPT_CHOICES", "PactOptions", "check_pact_options", "derived_options"]
