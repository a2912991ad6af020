"""Error-compensating NVFP4 rounding (GPTQ, Frantar et al. 2022) for a weight whose inputs are known.

Rounding each weight to its nearest NVFP4 value minimizes the weight's error; what a layer computes is `x @ W.T`, so
the error that matters is `||X (W - Q)^T||` over the inputs X the layer sees. GPTQ rounds one input column at a
time and moves the rounding error of that column onto the columns not yet rounded, weighted by the inverse Hessian
`H = X^T X` of the layer's inputs, so that the outputs stay close where the data lives. Blocks of 16 columns get their
e4m3 scale (the `scale_rule` search of `format.py`) when the rounding reaches them, from the weights as updated so
far; the per-tensor scale is the target's. With `H` the identity nothing moves and the result is `quantize(weight)`
bit for bit (tests/test_nvfp4_gptq.py).
"""

from __future__ import annotations

import torch

from .format import (
    BLOCK_SIZE,
    F4_E2M1_MAX,
    SCALE_RULES,
    _e2m1_round,
    float_to_e2m1,
    pack_e2m1,
    scale_blocks,
    tensor_scale,
)
from .tensor import NVFP4Tensor

DAMPING = 0.01  # of the Hessian's mean diagonal, added to it: GPTQ's default, keeps the inverse well conditioned
LAZY_BLOCK = 128  # columns updated together (GPTQ's lazy batch update), a multiple of BLOCK_SIZE


def _inverse_cholesky(h: torch.Tensor) -> torch.Tensor:
    """The upper Cholesky factor U of H^-1 (H^-1 = U^T U), which GPTQ's updates read, without forming H^-1: with J
    the reversal of rows and columns, J H J = L L^T gives H = R R^T for the upper R = J L J, so U = R^-1. One
    factorization and one triangular solve, ~1.6x faster than factor, invert, factor at K = 2048 (the same factor
    to float rounding), and most of a 1.5B model's merge is these for its 8960-input down_proj layers."""
    upper = torch.linalg.cholesky(h.flip(0, 1)).flip(0, 1)
    return torch.linalg.solve_triangular(upper, torch.eye(h.shape[0], dtype=h.dtype), upper=True)


def gptq_quantize(
    weight: torch.Tensor, hessian: torch.Tensor, damping: float = DAMPING, scale_rule: str = SCALE_RULES[0]
) -> NVFP4Tensor:
    """NVFP4 of `weight` [N, K] that keeps `x @ W.T` close for inputs with second moment `hessian` [K, K] (sum of
    `x x^T` over the layer's inputs)."""
    n, k = weight.shape
    if hessian.shape != (k, k):
        raise ValueError(f"gptq_quantize: hessian of shape {tuple(hessian.shape)} for a weight [{n}, {k}]")
    w = weight.detach().float().clone()
    scale_2 = tensor_scale(w)
    h = hessian.detach().double().clone()
    dead = torch.diagonal(h) == 0  # inputs that are always zero: their weights cannot matter
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    h += damping * torch.diagonal(h).mean() * torch.eye(k, dtype=h.dtype)
    inverse = _inverse_cholesky(h).float()
    grid = torch.empty_like(w)  # each element's E2M1 value
    scales = torch.empty(n, k // BLOCK_SIZE, dtype=torch.float32)
    for start in range(0, k, LAZY_BLOCK):
        end = min(start + LAZY_BLOCK, k)
        block, errors, inv = w[:, start:end].clone(), torch.zeros(n, end - start), inverse[start:end, start:end]
        for i in range(end - start):
            column = start + i
            if column % BLOCK_SIZE == 0:  # a block of 16 starts: its scale from the weights as they are now
                scale = scale_blocks(block[:, i : i + BLOCK_SIZE], scale_2, scale_rule)[0][:, 0]
                scales[:, column // BLOCK_SIZE] = scale
                reciprocal = (1.0 / scale_2) / scale  # as format._scaled computes it
            value = _e2m1_round((block[:, i] * reciprocal).clamp(-F4_E2M1_MAX, F4_E2M1_MAX))
            grid[:, column] = value
            error = (block[:, i] - (value * scale) * scale_2) / inv[i, i]
            block[:, i:] -= error.unsqueeze(1) * inv[i, i:].unsqueeze(0)
            errors[:, i] = error
        w[:, end:] -= errors @ inverse[start:end, end:]
    return NVFP4Tensor(pack_e2m1(float_to_e2m1(grid)), scales.to(torch.float8_e4m3fn), scale_2)


__all__ = ["DAMPING", "gptq_quantize"]
