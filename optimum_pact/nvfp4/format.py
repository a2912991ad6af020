"""NVFP4: FP4 E2M1 elements, one FP8 E4M3 scale per 16 elements along K, one FP32 scale per tensor.

Numerics follow torchao's `nvfp4_quantize` (two-level scaling) and the ModelOpt checkpoint layout:

* `scale_2 = amax / (6 * 448)` (FP32, per tensor)
* `scale = e4m3(clamp(block_amax / 6 / scale_2, min=E4M3_TINY, max=448))` (one per block of 16)
* `code = e2m1(clamp(w * ((1 / scale_2) / fp32(scale)), -6, 6))`, round half to even
* element `2i` of a row sits in the LOW nibble of byte `i`.

Dequantization is `fp32(fp32(E2M1[code] * fp32(scale)) * scale_2)`, then a cast to the compute dtype.
`E2M1[code] * fp32(scale)` is exact in FP32, so this equals torchao's `(E2M1 * scale) * scale_2` bit for bit.
This module is the reference; `kernels.py` holds the fast path, tested against it with atol=0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK_SIZE = 16
F4_E2M1_MAX = 6.0
F8E4M3_MAX = 448.0
E4M3_TINY = torch.finfo(torch.float8_e4m3fn).tiny  # 2**-6, torchao's E4M3_EPS

# The 16 E2M1 values in code order: sign bit 3, exponent bits 2-1, mantissa bit 0.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
# Midpoints between neighbouring magnitudes; a tie goes to the even code (mantissa bit 0).
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def e2m1_table(dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> torch.Tensor:
    """The 16 E2M1 values indexed by 4-bit code."""
    return torch.tensor(E2M1_VALUES, dtype=dtype, device=device)


def float_to_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Round FP32 values already clamped to [-6, 6] to E2M1 codes (uint8, one code per element), ties to even."""
    mag = x.abs()
    code = torch.zeros_like(mag, dtype=torch.uint8)
    for i, mid in enumerate(_MIDPOINTS):
        # midpoint i sits between codes i and i+1; an exact tie rounds to the even one of the two
        code += (mag > mid) if i % 2 == 0 else (mag >= mid)
    return code | (torch.signbit(x).to(torch.uint8) << 3)


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """Pack codes [..., K] into bytes [..., K/2]; element 2i goes to the low nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_e2m1`: bytes [..., K/2] -> codes [..., K]."""
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)


def _check_weight(weight: torch.Tensor) -> None:
    if weight.dim() != 2:
        raise ValueError(f"NVFP4 quantizes 2-D weights [out_features, in_features]; got shape {tuple(weight.shape)}.")
    if weight.shape[1] % BLOCK_SIZE != 0:
        raise ValueError(
            f"NVFP4 needs in_features to be a multiple of {BLOCK_SIZE}; got a weight of shape {tuple(weight.shape)}. "
            "Leave this layer unquantized (exclude it from target_modules)."
        )
    if not weight.dtype.is_floating_point:
        raise TypeError(f"NVFP4 quantizes floating-point weights; got dtype {weight.dtype}.")
    if not torch.isfinite(weight).all():
        raise ValueError("NVFP4 cannot quantize a weight holding NaN or inf values; fix or exclude this layer.")


@torch.no_grad()
def quantize(weight: torch.Tensor) -> NVFP4Tensor:
    """Quantize a 2-D weight [N, K] to NVFP4 (K must be a multiple of 16)."""
    _check_weight(weight)
    n, k = weight.shape
    w = weight.float().reshape(n, k // BLOCK_SIZE, BLOCK_SIZE)
    amax = w.abs().amax()
    # An all-zero weight keeps scale_2 = 0 only through the clamp below; use a unit scale instead.
    scale_2 = amax / (F8E4M3_MAX * F4_E2M1_MAX) if amax > 0 else torch.ones((), dtype=torch.float32)
    block_scale = w.abs().amax(dim=-1) / F4_E2M1_MAX / scale_2
    scale = block_scale.clamp(min=E4M3_TINY, max=F8E4M3_MAX).to(torch.float8_e4m3fn)
    reciprocal = (1.0 / scale_2) / scale.float()
    scaled = (w * reciprocal.unsqueeze(-1)).clamp(-F4_E2M1_MAX, F4_E2M1_MAX).reshape(n, k)
    return NVFP4Tensor(pack_e2m1(float_to_e2m1(scaled)), scale, scale_2.reshape(()).float())


def dequantize_reference(
    qdata: torch.Tensor, scale: torch.Tensor, scale_2: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Plain-torch dequantizer, the oracle for every fast path: uint8 [N, K/2] -> dtype [N, K]."""
    n, half_k = qdata.shape
    values = e2m1_table(device=qdata.device)[unpack_e2m1(qdata).long()]
    blocks = values.reshape(n, half_k * 2 // BLOCK_SIZE, BLOCK_SIZE) * scale.float().unsqueeze(-1)
    return (blocks * scale_2.float()).reshape(n, half_k * 2).to(dtype)


@dataclass
class NVFP4Tensor:
    """A packed NVFP4 weight: `qdata` uint8 [N, K/2], `scale` float8_e4m3fn [N, K/16], `scale_2` fp32 scalar."""

    qdata: torch.Tensor
    scale: torch.Tensor
    scale_2: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.qdata.shape[0], self.qdata.shape[1] * 2))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qdata, self.scale, self.scale_2))

    def absmax(self) -> float:
        """An upper bound of max |deq(W)|: the largest block scale times 6 (E2M1's largest magnitude)."""
        if self.scale.numel() == 0:
            return 0.0
        # fp32(e4m3) * scale_2 in fp32, as the reference dequantizer forms each block's scale
        return float(self.scale.float().abs().amax() * self.scale_2.float().reshape(())) * F4_E2M1_MAX

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        from .kernels import dequantize

        return dequantize(self.qdata, self.scale, self.scale_2, dtype)

    def to(self, device: torch.device | str) -> NVFP4Tensor:
        return NVFP4Tensor(self.qdata.to(device), self.scale.to(device), self.scale_2.to(device))
