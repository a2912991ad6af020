from .format import (
    BLOCK_SIZE,
    E2M1_VALUES,
    F4_E2M1_MAX,
    F8E4M3_MAX,
    NVFP4Tensor,
    dequantize_reference,
    float_to_e2m1,
    pack_e2m1,
    quantize,
    unpack_e2m1,
)
from .kernels import dequantize

__all__ = [
    "BLOCK_SIZE",
    "E2M1_VALUES",
    "F4_E2M1_MAX",
    "F8E4M3_MAX",
    "NVFP4Tensor",
    "dequantize",
    "dequantize_reference",
    "float_to_e2m1",
    "pack_e2m1",
    "quantize",
    "unpack_e2m1",
]
