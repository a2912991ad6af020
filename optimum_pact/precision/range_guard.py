"""Per-row range guard for products computed in fp16.

An fp16 product `y = a @ W` (or `a @ W.T`) overflows when an output element exceeds 65504. Each output element of
row `i` is bounded by `sum_k |a_ik| * max|W| = ||a_i||_1 * max|W|`, so scaling row `i` by `2**-e_i` with
`||a_i||_1 * 2**-e_i * max|W| <= LIMIT` makes overflow impossible, not merely unlikely, also for every partial sum
of the accumulation. Multiplying the fp32 result by `2**e_i` afterwards is exact: the powers of two change
exponents only. A row is *guarded* when the bound forces it below the scale it would otherwise run at.

`normalize=True` (the NPU's fp16 graphs) also brings every row's largest |value| into [1, 2) first, so that inputs
coming from fp32 / bf16 neither overflow nor fall into fp16 subnormals; `normalize=False` (fp16 tensors on the
torch backend) touches only the rows that could overflow, leaving every other row bit-identical.
"""

from __future__ import annotations

import torch

LIMIT = 2.0**15  # half of fp16's range: headroom for the rounding of the accumulation


def row_exponents(a: torch.Tensor, weight_absmax: float, normalize: bool = True) -> tuple[torch.Tensor, int]:
    """Per-row power-of-two exponents `e` [rows, 1] (int32, CPU) for `a` [rows, k], and how many rows are guarded.

    Run the product on `a * 2**-e` (in fp16) and multiply its rows by `2**e` in fp32. `weight_absmax` is the
    largest |value| of the weight as the product sees it (an upper bound is fine).
    """
    a32 = a.detach().float()
    l1 = a32.abs().sum(dim=1, keepdim=True).cpu()
    if normalize:
        amax = a32.abs().amax(dim=1, keepdim=True).cpu()
        ok = (amax > 0) & torch.isfinite(amax)
        exp = torch.where(ok, torch.frexp(amax).exponent - 1, torch.zeros_like(amax, dtype=torch.int32))
    else:
        exp = torch.zeros_like(l1, dtype=torch.int32)
    bound = torch.ldexp(l1, -exp.float()) * float(weight_absmax)
    over = (bound > LIMIT) & torch.isfinite(bound)
    # the smallest extra shift s with bound * 2**-s <= LIMIT
    extra = torch.where(over, torch.frexp(bound / LIMIT).exponent, torch.zeros_like(exp))
    extra = torch.where(over & (torch.ldexp(bound, -extra.float() + 1) <= LIMIT), extra - 1, extra)
    return exp + extra, int(over.sum())


def scale_rows(a: torch.Tensor, exp: torch.Tensor, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """`a * 2**-exp` row by row, out of place, in `dtype` (computed in fp32, so exact before the final rounding)."""
    return torch.ldexp(a.float(), -exp.to(a.device).float()).to(dtype)


def unscale_rows(y: torch.Tensor, exp: torch.Tensor, shift: int = 0) -> torch.Tensor:
    """`y * 2**(exp + shift)` row by row in fp32 (exact)."""
    return torch.ldexp(y.float(), (exp.to(y.device) + shift).float())
