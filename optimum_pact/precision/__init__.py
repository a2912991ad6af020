"""Precision: the FP16 per-row range guard, the gradient-sensitivity probe and the per-layer precision plan."""

from .plan import PRECISIONS, LayerSensitivity, plan_precision
from .probe import probe_sensitivity
from .range_guard import row_exponents, scale_rows, unscale_rows

__all__ = [
    "PRECISIONS",
    "LayerSensitivity",
    "plan_precision",
    "probe_sensitivity",
    "row_exponents",
    "scale_rows",
    "unscale_rows",
]
