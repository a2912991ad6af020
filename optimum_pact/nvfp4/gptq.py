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
LAZY_BLOCK = 32  # columns updated together (GPTQ's lazy batch update), a multiple of BLOCK_SIZE


def _inverse_cholesky(h: torch.Tensor) -> torch.Tensor:
    """The upper Cholesky factor U of H^-1 (H^-1 = U^T U), which GPTQ's updates read, without forming H^-1: with J
    the reversal of rows and columns, J H J = L L^T gives H = R R^T for the upper R = J L J, so U = R^-1. One
    factorization and one triangular inverse, ~1.6x faster than factor, invert, factor at K = 2048 (the same factor
    to float rounding), and most of a 1.5B model's merge is these for its 8960-input down_proj layers."""
    upper = torch.linalg.cholesky(h.flip(0, 1)).flip(0, 1)
    return _upper_inverse(upper)


def _upper_inverse(upper: torch.Tensor, leaf: int = 128) -> torch.Tensor:
    """The inverse of an upper-triangular matrix, by halves: inv([[A, B], [0, C]]) = [[A^-1, -A^-1 B C^-1], [0, C^-1]].
    A third of the arithmetic of solving against the identity, in matrix products (half the time at K = 1536, to
    float rounding); triangular solves below `leaf` rows."""
    n = upper.shape[0]
    if n <= leaf:
        return torch.linalg.solve_triangular(upper, torch.eye(n, dtype=upper.dtype), upper=True)
    m = n // 2
    first, last = _upper_inverse(upper[:m, :m], leaf), _upper_inverse(upper[m:, m:], leaf)
    out = torch.zeros_like(upper)
    out[:m, :m], out[m:, m:] = first, last
    out[:m, m:] = -(first @ upper[:m, m:]) @ last
    return out


def gptq_quantize(
    weight: torch.Tensor, hessian: torch.Tensor, damping: float = DAMPING, scale_rule: str = SCALE_RULES[0]
) -> NVFP4Tensor:
    """NVFP4 of `weight` [N, K] that keeps `x @ W.T` close for inputs with second moment `hessian` [K, K] (sum of
    `x x^T` over the layer's inputs)."""
    return gptq_quantize_many([(weight, hessian)], damping, scale_rule)[0]


def gptq_quantize_many(
    pairs: list[tuple[torch.Tensor, torch.Tensor]], damping: float = DAMPING, scale_rule: str = SCALE_RULES[0]
) -> list[NVFP4Tensor]:
    """`gptq_quantize` of each (weight, hessian) pair, the same result in far fewer steps: weights that share one
    hessian object (q, k and v read one input) are rounded as one weight of their rows joined, each keeping its own
    per-tensor scale (GPTQ treats rows alone), and groups of one shape go through the column loop together."""
    groups: dict[int, list[int]] = {}  # id of a hessian -> the pairs that read it
    for i, (weight, hessian) in enumerate(pairs):
        n, k = weight.shape
        if hessian.shape != (k, k):
            raise ValueError(f"gptq_quantize: hessian of shape {tuple(hessian.shape)} for a weight [{n}, {k}]")
        groups.setdefault(id(hessian), []).append(i)
    shapes: dict[tuple[int, int], list[list[int]]] = {}
    for members in groups.values():
        rows = sum(pairs[i][0].shape[0] for i in members)
        shapes.setdefault((rows, pairs[members[0]][0].shape[1]), []).append(members)
    out: list[NVFP4Tensor | None] = [None] * len(pairs)
    for batch in shapes.values():
        w = torch.stack([torch.cat([pairs[i][0].detach().float() for i in members]) for members in batch])
        s2 = torch.stack([torch.cat([tensor_scale(pairs[i][0].detach().float()).expand(pairs[i][0].shape[0])
                                     for i in members]) for members in batch])  # fmt: skip
        grid, scales = _gptq(w, [pairs[members[0]][1] for members in batch], s2, damping, scale_rule)
        for b, members in enumerate(batch):
            row = 0
            for i in members:
                n = pairs[i][0].shape[0]
                codes = pack_e2m1(float_to_e2m1(grid[b, row : row + n]))
                out[i] = NVFP4Tensor(codes, scales[b, row : row + n].to(torch.float8_e4m3fn), s2[b, row].clone())
                row += n
    return out


def _gptq(w: torch.Tensor, hessians: list[torch.Tensor], s2: torch.Tensor, damping: float, scale_rule: str):
    """The GPTQ column loop over a batch: weights [L, N, K] (fp32, consumed), one hessian [K, K] per weight,
    per-row tensor scales [L, N]. Returns each element's E2M1 value [L, N, K] and the block scales [L, N, K/16].
    The loop runs on the weights transposed, [K, L, N], so that every step reads and writes whole contiguous rows,
    and writes each rounded column's values over that column: one copy of the weights in all."""
    layers, n, k = w.shape
    inverse = torch.empty(layers, k, k)
    for b, hessian in enumerate(hessians):
        hb = hessian.detach().double()  # a copy: the caller's moments stay as they are
        dead = torch.diagonal(hb) == 0  # inputs that are always zero: their weights cannot matter
        hb[dead, dead] = 1.0
        w[b][:, dead] = 0.0
        hb += damping * torch.diagonal(hb).mean() * torch.eye(k, dtype=hb.dtype)
        inverse[b] = _inverse_cholesky(hb).float()
        del hb
    wt = w.permute(2, 0, 1).contiguous()  # [K, L, N]
    del w
    scales = torch.empty(k // BLOCK_SIZE, layers, n, dtype=torch.float32)
    flat_s2 = s2.reshape(-1, 1)
    for start in range(0, k, LAZY_BLOCK):
        end = min(start + LAZY_BLOCK, k)
        block = wt[start:end].clone()
        rows = inverse[:, start:end, start:end].permute(1, 2, 0).contiguous()  # [i, j, L]: row i of each inverse
        errors = torch.empty_like(block)
        for i in range(end - start):
            column = start + i
            if column % BLOCK_SIZE == 0:  # a block of 16 starts: its scale from the weights as they are now
                part = block[i : i + BLOCK_SIZE].permute(1, 2, 0).reshape(-1, BLOCK_SIZE)
                scale = scale_blocks(part, flat_s2, scale_rule)[0][:, 0].reshape(layers, n)
                scales[column // BLOCK_SIZE] = scale
                reciprocal = (1.0 / s2) / scale  # as format._scaled computes it
            value = _e2m1_round((block[i] * reciprocal).clamp(-F4_E2M1_MAX, F4_E2M1_MAX))
            wt[column] = value  # the column is rounded: its place holds its E2M1 values from here on
            error = (block[i] - (value * scale) * s2) / rows[i, i].unsqueeze(1)
            block[i:].addcmul_(rows[i, i:].unsqueeze(2), error.unsqueeze(0), value=-1.0)
            errors[i] = error
        if end < k:  # the block's errors onto the columns not yet rounded
            wt[end:] -= torch.einsum("lbk,bln->kln", inverse[:, start:end, end:], errors)
    return wt.permute(1, 2, 0), scales.permute(1, 2, 0)


__all__ = ["DAMPING", "gptq_quantize", "gptq_quantize_many"]
