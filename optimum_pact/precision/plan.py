"""The per-layer precision plan: which frozen linears keep a 16-bit weight, under a memory budget."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass

PRECISIONS = ("nvfp4", "fp16")
NVFP4_BYTES_PER_WEIGHT = 0.5 + 1 / 16  # 4-bit codes + one e4m3 scale per 16 weights
FP16_BYTES_PER_WEIGHT = 2.0


def sixteen_bit_modules(precision_plan: Mapping[str, str] | None, protected: Iterable[str] | None) -> list[str]:
    """The linears an adapter was trained with 16-bit, sorted: its precision plan's fp16 ones and AQLoRA's protected
    ones (`PactConfig.sixteen_bit_modules`; read from `pact_config.json` where peft is not imported)."""
    plan = {name for name, precision in (precision_plan or {}).items() if precision == "fp16"}
    return sorted(plan | set(protected or ()))


@dataclass
class LayerSensitivity:
    """How much one frozen linear's NVFP4 weight moves the gradients, measured against its 16-bit weight.

    `output_error` and `input_grad_error` are local: ||x (Wq - W)^T|| / ||x W^T|| and ||dy (Wq - W)|| / ||dy W||
    with the layer's own calibration input `x` and output gradient `dy`. `adapter_grad_change` is global:
    ||g_q - g|| / ||g|| over all adapter gradients when this layer alone uses NVFP4 (None when not measured).
    """

    name: str
    out_features: int
    in_features: int
    output_error: float
    input_grad_error: float
    adapter_grad_change: float | None = None

    @property
    def score(self) -> float:
        """What the plan ranks by: the adapter-gradient change where measured, else the input-gradient error."""
        return self.input_grad_error if self.adapter_grad_change is None else self.adapter_grad_change

    @property
    def fp16_premium_bytes(self) -> float:
        """Extra memory of keeping this layer 16-bit instead of NVFP4."""
        return self.out_features * self.in_features * (FP16_BYTES_PER_WEIGHT - NVFP4_BYTES_PER_WEIGHT)

    def to_dict(self) -> dict:
        return asdict(self)


def plan_precision(sensitivities: Iterable[LayerSensitivity], budget_mib: float) -> dict[str, str]:
    """Assign each layer "nvfp4" or "fp16": the most sensitive layers per byte go fp16 while the premium fits.

    `budget_mib` is the memory allowed above all-NVFP4 (0 keeps every layer NVFP4; `math.inf` makes all fp16).
    Greedy by sensitivity per premium byte (ties by name, so the plan is reproducible); layers that the probe
    found insensitive (score 0) stay NVFP4.
    """
    if isinstance(budget_mib, bool) or not isinstance(budget_mib, (int, float)) or math.isnan(budget_mib):
        raise ValueError(f"precision budget_mib={budget_mib!r} must be a number of MiB >= 0.")
    if budget_mib < 0:
        raise ValueError(f"precision budget_mib={budget_mib} must be >= 0 (0 keeps every layer NVFP4).")
    layers = list(sensitivities)
    plan = {s.name: "nvfp4" for s in layers}
    left = budget_mib * 2**20
    for s in sorted(layers, key=lambda s: (-s.score / s.fp16_premium_bytes, s.name)):
        if s.score > 0 and s.fp16_premium_bytes <= left:
            plan[s.name] = "fp16"
            left -= s.fp16_premium_bytes
    return plan


def check_plan(plan: Mapping[str, str] | None, option: str = "precision_plan") -> None:
    """A plan maps module names to one of `PRECISIONS`; anything else is a clear error naming `option`."""
    if plan is None:
        return
    if not isinstance(plan, Mapping):
        raise ValueError(f"{option}={plan!r} must be a dict of module name -> one of {PRECISIONS}, or None.")
    bad = {name: p for name, p in plan.items() if not isinstance(name, str) or p not in PRECISIONS}
    if bad:
        shown = dict(list(bad.items())[:3])
        raise ValueError(f"{option} has entries that are not module name -> one of {PRECISIONS}: {shown}.")
