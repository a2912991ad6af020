from .format import (
    BLOCK_SIZE,
    E2M1_VALUES,
    F4_E2M1_MAX,
    F8E4M3_MAX,
    SCALE_RULES,
    dequantize_reference,
    fake_quantize,
    float_to_e2m1,
    pack_e2m1,
    tensor_scale,
    unpack_e2m1,
)
from .kernels import dequantize
from .tensor import NVFP4Tensor, quantize

__all__ = [
    "BLOCK_SIZE",
    "E2M1_VALUES",
    "F4_E2M1_MAX",
    "F8E4M3_MAX",
    "NVFP4Tensor",
    "SCALE_RULES",
    "dequantize",
    "dequantize_reference",
    "fake_quantize",
    "float_to_e2m1",
    "pack_e2m1",
    "quantize",
    "tensor_scale",
    "unpack_e2m1",
]
