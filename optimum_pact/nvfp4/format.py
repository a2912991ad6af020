"""NVFP4: FP4 E2M1 elements, one FP8 E4M3 scale per 16 elements along K, one FP32 scale per tensor.

The layout is the ModelOpt checkpoint layout, and the two-level scaling follows torchao's `nvfp4_quantize`:

* `scale_2 = amax / (6 * 448)` (FP32, per tensor)
* `scale = e4m3(clamp(block_amax / m / scale_2, min=E4M3_TINY, max=448))` (one per block of 16)
* `code = e2m1(clamp(w * ((1 / scale_2) / fp32(scale)), -6, 6))`, round half to even
* element `2i` of a row sits in the LOW nibble of byte `i`.

How each block's e4m3 scale is chosen is the scale rule (`SCALE_RULES`). `"6"` maps every block's largest magnitude
to 6, as torchao and ModelOpt do (bit for bit). `"4/6"` is Four Over Six (Cook et al., 2025, arXiv:2512.02010):
each block takes the scale that maps its largest magnitude to 4 or the one that maps it to 6, whichever
reconstructs it with the smaller squared error; E2M1 has no value between 4 and 6, so under "6" an element at 5/6
of its block's largest comes back 20% off, mapped to 4 it is 10% off. `"mse"`, the default, searches further: each
block tries the e4m3 scales from one code below rule 6's to six codes above it (4's sits four to six codes above)
and 4's own, and keeps the one with the smallest squared error, as llm-compressor's MSE observer searches its
scales. On Gaussian and heavy-tailed weights that is the best of all 119 scales e4m3 can store in over 98% of
blocks (tests/test_nvfp4_format.py). The tensor scale stays torchao's, so a block above 2/3 of the tensor's amax
cannot reach 4 (its scale stops at 448), and no block at 448 takes a smaller scale: the tensor's amax comes back
whole, and quantizing a reconstruction again changes nothing. Only the quantizer chooses: the bytes are plain NVFP4
and every dequantizer reads them unchanged.

Dequantization is `fp32(fp32(E2M1[code] * fp32(scale)) * scale_2)`, then a cast to the compute dtype.
`E2M1[code] * fp32(scale)` is exact in FP32, so this equals torchao's `(E2M1 * scale) * scale_2` bit for bit.
This module is the reference, on plain tensors; `fake_quantize` is the quantize-dequantize round trip without
packing. `kernels.py` holds the fast dequantizer (tested against `dequantize_reference` with atol=0), `tensor.py` the
packed `NVFP4Tensor` and `quantize`.
"""

from __future__ import annotations

import math

import torch

BLOCK_SIZE = 16
F4_E2M1_MAX = 6.0
F8E4M3_MAX = 448.0
E4M3_TINY = torch.finfo(torch.float8_e4m3fn).tiny  # 2**-6, torchao's E4M3_EPS
_E4M3_TINY_CODE, _E4M3_MAX_CODE = 0x08, 0x7E  # the e4m3 bit patterns of E4M3_TINY and F8E4M3_MAX
SCALE_RULES = ("mse", "4/6", "6")  # how each block's e4m3 scale is chosen; the first is the default
MSE_CODE_STEPS = range(-1, 7)  # "mse": e4m3 codes tried around rule 6's scale (4's sits 4-6 codes above it)

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


def tensor_scale(weight: torch.Tensor) -> torch.Tensor:
    """The per-tensor scale `scale_2 = amax / (6 * 448)`, an fp32 scalar, under either scale rule; 1 for an all-zero
    weight (not 0, which would make every block scale 0 / 0)."""
    amax = weight.detach().abs().amax().float()
    return amax / (F8E4M3_MAX * F4_E2M1_MAX) if amax > 0 else torch.ones((), dtype=torch.float32)


def check_scale_rule(scale_rule: str) -> None:
    if scale_rule not in SCALE_RULES:
        raise ValueError(
            f"scale_rule={scale_rule!r} is not an NVFP4 scale rule; choose one of {', '.join(map(repr, SCALE_RULES))} "
            '("6" is torchao\'s and ModelOpt\'s quantizer bit for bit, "4/6" Four Over Six).'
        )


def _block_scales(block_amax: torch.Tensor, scale_2: torch.Tensor, target: float) -> torch.Tensor:
    """e4m3 block scales (held in fp32) that map each block's largest magnitude to `target`."""
    scale = (block_amax / target / scale_2).clamp(min=E4M3_TINY, max=F8E4M3_MAX)
    return scale.to(torch.float8_e4m3fn).float()


def _scaled(w: torch.Tensor, scale: torch.Tensor, scale_2: torch.Tensor) -> torch.Tensor:
    reciprocal = (1.0 / scale_2) / scale
    return (w * reciprocal.unsqueeze(-1)).clamp(-F4_E2M1_MAX, F4_E2M1_MAX)


def scale_blocks(
    weight: torch.Tensor, scale_2: torch.Tensor | None = None, scale_rule: str = SCALE_RULES[0]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The two-level scaling `quantize` and `fake_quantize` share: checks the weight [N, K], then returns the block
    scales [N, K/16] (e4m3 values, held in fp32), the fp32 elements scaled into [-6, 6] as blocks [N, K/16, 16],
    and `scale_2`.

    `scale_2` defaults to `tensor_scale(weight)`; pass the whole weight's when `weight` is a slice of its rows.
    `scale_rule` as in the module docstring; a tie in squared error keeps rule 6's scale.
    """
    _check_weight(weight)
    check_scale_rule(scale_rule)
    n, k = weight.shape
    w = weight.detach().float().reshape(n, k // BLOCK_SIZE, BLOCK_SIZE)
    block_amax = w.abs().amax(dim=-1)
    amax = block_amax.amax()
    if not math.isfinite(amax):  # amax propagates NaN and inf from any element
        raise ValueError("NVFP4 cannot quantize a weight holding NaN or inf values; fix or exclude this layer.")
    if scale_2 is None:
        scale_2 = tensor_scale(amax)
    scale = _block_scales(block_amax, scale_2, F4_E2M1_MAX)
    if scale_rule != "6":
        candidates = [_block_scales(block_amax, scale_2, 4.0)]
        if scale_rule == "mse":
            candidates += _searched_scales(scale)
        magnitude = w.abs()
        error = _block_error(magnitude, scale, scale_2)
        for candidate in candidates:
            candidate_error = _block_error(magnitude, candidate, scale_2)
            better = candidate_error < error  # a tie keeps the earlier scale: rule 6's first
            error = torch.where(better, candidate_error, error)
            scale = torch.where(better, candidate, scale)
    return scale, _scaled(w, scale, scale_2), scale_2


def _searched_scales(six: torch.Tensor) -> list[torch.Tensor]:
    """The "mse" rule's candidates besides 6's and 4's: the e4m3 scales `MSE_CODE_STEPS` codes from rule 6's `six`
    (codes of one sign are ordered like their values: code + 1 is the next larger scale). None below 448 where rule
    6's is 448: that block may hold the tensor's amax, which must come back whole, or quantizing the reconstruction
    again would start from another `scale_2`. Every other block of a reconstruction finds a scale that reproduces it
    (its own, 4's, or 6's when its largest came back as 3), so quantizing `fake_quantize(w)` again changes nothing."""
    codes = six.to(torch.float8_e4m3fn).view(torch.uint8).to(torch.int16)
    found = []
    for step in MSE_CODE_STEPS:
        if step:
            code = (codes + step).clamp_(min=_E4M3_TINY_CODE, max=_E4M3_MAX_CODE)
            if step < 0:
                code = torch.where(codes == _E4M3_MAX_CODE, codes, code)
            found.append(code.to(torch.uint8).view(torch.float8_e4m3fn).float())
    return found


def _reconstructed(scaled: torch.Tensor, scale: torch.Tensor, scale_2: torch.Tensor) -> torch.Tensor:
    """What the dequantizer makes of scaled blocks [N, K/16, 16], with its arithmetic, in fp32."""
    return (_e2m1_round(scaled) * scale.unsqueeze(-1)) * scale_2


def _block_error(magnitude: torch.Tensor, scale: torch.Tensor, scale_2: torch.Tensor) -> torch.Tensor:
    """Squared error of each block's reconstruction under block scales `scale`, [N, K/16], from the magnitudes of its
    elements [N, K/16, 16]: `_reconstructed(_scaled(w, ...), ...) - w` squared and summed, bit for bit (every step is
    odd in w, so the signs drop out), in half the time: the scale search runs it once per candidate."""
    x = (magnitude * ((1.0 / scale_2) / scale).unsqueeze(-1)).clamp_(max=F4_E2M1_MAX)
    step = (x >= 2).float().add_((x >= 4).float()).exp2_().mul_(0.5)  # as in _e2m1_round
    rounded = x.div_(step).round_().mul_(step)
    per_row = scale_2.unsqueeze(-1) if scale_2.dim() else scale_2  # a scale per row [N, 1] (batched GPTQ)
    return rounded.mul_(scale.unsqueeze(-1)).mul_(per_row).sub_(magnitude).square_().sum(dim=-1)


def _e2m1_round(x: torch.Tensor) -> torch.Tensor:
    """E2M1 value of each element of `x` (fp32 in [-6, 6]), ties to even: `E2M1[float_to_e2m1(x)]` bit for bit.

    E2M1's grid has step 0.5 below 2, 1 below 4 and 2 up to 6; dividing by a power-of-two step is exact and
    `torch.round` rounds half to even, which is the even code. Twice as fast as the code path; tested against it.
    """
    mag = x.abs()
    step = (mag >= 2).float().add_((mag >= 4).float()).exp2_().mul_(0.5)
    return torch.round(mag / step).mul_(step).copysign_(x)


def fake_quantize(
    weight: torch.Tensor, scale_2: torch.Tensor | None = None, scale_rule: str = SCALE_RULES[0]
) -> torch.Tensor:
    """What NVFP4 makes of `weight`, as fp32 [N, K]: `dequantize_reference(q.qdata, q.scale, q.scale_2)` for
    `q = quantize(weight)`, bit for bit, without forming or packing any code.

    `scale_2` as in `scale_blocks`: a caller can go through a big weight in slices of rows with the whole one's scale.
    """
    scale, scaled, scale_2 = scale_blocks(weight, scale_2, scale_rule)
    return _reconstructed(scaled, scale, scale_2).reshape(weight.shape)


def dequantize_reference(
    qdata: torch.Tensor, scale: torch.Tensor, scale_2: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Plain-torch dequantizer, the oracle for every fast path: uint8 [N, K/2] -> dtype [N, K]."""
    n, half_k = qdata.shape
    values = e2m1_table(device=qdata.device)[unpack_e2m1(qdata).long()]
    blocks = values.reshape(n, half_k * 2 // BLOCK_SIZE, BLOCK_SIZE) * scale.float().unsqueeze(-1)
    return (blocks * scale_2.float()).reshape(n, half_k * 2).to(dtype)
