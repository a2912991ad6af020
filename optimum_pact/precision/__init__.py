"""Precision: the FP16 per-row range guard, the gradient-sensitivity probe and the per-layer precision plan."""

from .compute_dtype import DTYPES, native_bf16, resolve_dtype
from .plan import PRECISIONS, LayerSensitivity, plan_precision
from .probe import probe_sensitivity
from .range_guard import row_exponents, scale_rows, unscale_rows

__all__ = [
    "DTYPES",
    "PRECISIONS",
    "LayerSensitivity",
    "plan_precision",
    "native_bf16",
    "probe_sensitivity",
    "resolve_dtype",
    "row_exponents",
    "scale_rows",
    "unscale_rows",
]
