"""`NVFP4Tensor`, a packed NVFP4 weight, and `quantize`, which makes one (numerics in `format.py`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .format import F4_E2M1_MAX, SCALE_RULES, float_to_e2m1, pack_e2m1, scale_blocks
from .kernels import dequantize


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
        return dequantize(self.qdata, self.scale, self.scale_2, dtype)

    def to(self, device: torch.device | str) -> NVFP4Tensor:
        return NVFP4Tensor(self.qdata.to(device), self.scale.to(device), self.scale_2.to(device))


@torch.no_grad()
def quantize(weight: torch.Tensor, scale_rule: str = SCALE_RULES[0]) -> NVFP4Tensor:
    """Quantize a 2-D weight [N, K] to NVFP4 (K must be a multiple of 16); `scale_rule` as in `format.py`."""
    scale, scaled, scale_2 = scale_blocks(weight, scale_rule=scale_rule)
    codes = pack_e2m1(float_to_e2m1(scaled.reshape(weight.shape)))
    return NVFP4Tensor(codes, scale.to(torch.float8_e4m3fn), scale_2)  # exact: the scales are e4m3 values
