"""Triton kernels for the frozen products on CUDA, reading the one resident `NVFP4Tensor` as it is.

`forward(x, w)` is `x @ deq(W).T` (also the recomputation) and `input_grad(dy, w)` is `dy @ deq(W)`, for W [N, K]
packed as NVFP4: codes uint8 [N, K/2] (element 2i in the LOW nibble), e4m3 block scales [N, K/16], fp32 `scale_2`.
Each program dequantizes the weight tile it needs in registers, with the reference's arithmetic
`fp32(fp32(E2M1[code] * fp32(scale)) * scale_2)` cast to the activation dtype, so the effective weights are those of
`optimum_pact.nvfp4.dequantize` bit for bit; `tl.dot` sums in fp32 (fp32 activations: full fp32, not TF32, as torch's
own matmul) and the result is rounded once into the activation dtype. No dequantized or transposed weight is ever
written to memory.

Tiles are autotuned per (rows bucket, N, K, dtype) among a few configurations (`CONFIGS`): small-row ones with
narrow column tiles, so that a decoding step (one row) still spreads over many programs, ones within the 64 KiB of
shared memory of the smaller cards, and the large tiles of the big ones (a configuration a card cannot hold is
skipped by the tuner). The tuning times each candidate once per key in a process; sums stay fp32 whichever wins, so
two processes agree within one rounding of the activation dtype, not always bit for bit. Explicit `blocks` (the
tests, and the interpreter, which cannot time) bypass it.

The codes and scales are decoded with integer ops and bit casts, not the GPU's fp8 conversions, so the kernels run on
any GPU Triton supports (the consumer cards before fp8 too), and under `TRITON_INTERPRET=1` on the CPU, which is how
the tests check them without a GPU (tests/test_triton_kernels.py). This module imports triton: import it only where
triton is installed; `optimum_pact.backends.triton_dispatch` decides which products come here.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from ..nvfp4 import NVFP4Tensor
from .base import TRITON_DTYPES as DTYPES

GROUP_M = 8  # row tiles visited together, so neighbouring programs share weight tiles in L2
# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages): decoding (few rows, narrow column tiles: more programs), then
# tiles within 64 KiB of shared memory (T4, consumer cards), then the big cards' (about 78 KiB and more)
CONFIGS = (
    (16, 32, 128, 4, 3), (16, 64, 64, 4, 3), (16, 64, 128, 4, 2),
    (32, 64, 64, 4, 3), (64, 64, 64, 4, 3), (64, 128, 64, 4, 2), (128, 64, 64, 4, 3),
    (128, 128, 64, 8, 3), (128, 128, 32, 8, 4), (128, 256, 64, 8, 3),
)  # fmt: skip


def _rows_bucket(m: int) -> int:
    """The autotuning key for `m` rows: 1, 16, 64, 256 or more (a new length of text does not re-tune)."""
    return 1 if m <= 1 else 16 if m <= 16 else 64 if m <= 64 else 256


def _fitting(configs, named_args, **kwargs):
    """Drop configurations whose row tile is far larger than the rows (a decoding step needs no 128-row tile)."""
    rows = max(16, named_args["M_BUCKET"])
    kept = [c for c in configs if c.kwargs["BLOCK_M"] <= rows] or list(configs)
    return kept


def _tuned(kernel):
    configs = [
        triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k}, num_warps=warps, num_stages=stages)
        for m, n, k, warps, stages in CONFIGS
    ]
    return triton.autotune(
        configs, key=["M_BUCKET", "N", "K", "PRECISION"], prune_configs_by={"early_config_prune": _fitting}
    )(kernel)


@triton.jit
def _e2m1(code):
    """int32 E2M1 codes (sign bit 3, exponent bits 2-1, mantissa bit 0) -> their fp32 values, exactly."""
    exponent = (code >> 1) & 3
    mantissa = code & 1
    normal = (((exponent + 126) << 23) | (mantissa << 22)).to(tl.float32, bitcast=True)
    magnitude = tl.where(exponent == 0, mantissa.to(tl.float32) * 0.5, normal)
    return tl.where((code & 8) != 0, -magnitude, magnitude)


@triton.jit
def _e4m3(byte):
    """int32 float8_e4m3fn bit patterns (never the NaN ones) -> their fp32 values, exactly."""
    exponent = (byte >> 3) & 15
    mantissa = byte & 7
    normal = (((exponent + 120) << 23) | (mantissa << 20)).to(tl.float32, bitcast=True)
    magnitude = tl.where(exponent == 0, mantissa.to(tl.float32) * 0.001953125, normal)  # subnormal: m * 2**-9
    return tl.where((byte & 128) != 0, -magnitude, magnitude)


@triton.jit
def _weight_tile(
    q_ptr, s_ptr, scale_2, offs_n, k0, N, K, stride_qn, stride_sn,
    dtype: tl.constexpr, INTERPRETED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """deq(W)[offs_n, k0 : k0 + BLOCK_K] as a [BLOCK_N, BLOCK_K] tile of `dtype`; zero outside W (K is a multiple
    of 16 and so is BLOCK_K: a block of 16 is all in or all out)."""
    rows = offs_n.to(tl.int64)[:, None]
    in_rows = offs_n[:, None] < N
    offs_byte = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    packed = tl.load(
        q_ptr + rows * stride_qn + offs_byte[None, :], mask=in_rows & (offs_byte[None, :] < K // 2), other=0
    ).to(tl.int32)
    codes = tl.interleave(packed & 15, packed >> 4)  # element 2i is the low nibble of byte i
    offs_block = k0 // 16 + tl.arange(0, BLOCK_K // 16)
    scale_bits = tl.load(
        s_ptr + rows * stride_sn + offs_block[None, :], mask=in_rows & (offs_block[None, :] < K // 16), other=0
    ).to(tl.int32)
    values = tl.reshape(_e2m1(codes), (BLOCK_N, BLOCK_K // 16, 16))
    scaled = values * _e4m3(scale_bits)[:, :, None]  # exact in fp32: 2 and 4 significant bits
    return _cast(tl.reshape(scaled, (BLOCK_N, BLOCK_K)) * scale_2, dtype, INTERPRETED)


@triton.jit
def _cast(x, dtype: tl.constexpr, INTERPRETED: tl.constexpr):
    """fp32 `x` rounded to nearest-even into `dtype`, as the GPU's conversion does. The interpreter truncates
    fp32 -> bf16, so there (INTERPRETED) bf16 is rounded with integer ops instead (finite values: all there are)."""
    if INTERPRETED and dtype == tl.bfloat16:
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        return bits.to(tl.int16).to(tl.bfloat16, bitcast=True)
    return x.to(dtype)


@triton.jit
def _dot(a, b, acc, PRECISION: tl.constexpr, INTERPRETED: tl.constexpr):
    """acc + a @ b summed in fp32. The interpreter's dot multiplies bf16's raw bits, so there (INTERPRETED) bf16
    operands are widened first: exact, so the sums are those of a bf16 dot with fp32 accumulation."""
    if INTERPRETED and a.dtype == tl.bfloat16:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def _tile_ids(M, COLS, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr, GROUP: tl.constexpr):
    """This program's (row tile, column tile), GROUP row tiles at a time down each column of tiles."""
    pid = tl.program_id(0)
    tiles_m, tiles_c = tl.cdiv(M, BLOCK_M), tl.cdiv(COLS, BLOCK_C)
    per_group = GROUP * tiles_c
    first_m = (pid // per_group) * GROUP
    group_m = tl.minimum(tiles_m - first_m, GROUP)
    return first_m + (pid % per_group) % group_m, (pid % per_group) // group_m


@_tuned
@triton.jit
def _forward_kernel(
    x_ptr, q_ptr, s_ptr, s2_ptr, y_ptr, M, N, K, stride_xm, stride_qn, stride_sn, stride_ym, M_BUCKET,
    PRECISION: tl.constexpr, INTERPRETED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
):  # fmt: skip
    """y [M, N] = x [M, K] @ deq(W).T, one [BLOCK_M, BLOCK_N] tile per program, summed over K in fp32."""
    pid_m, pid_n = _tile_ids(M, N, BLOCK_M, BLOCK_N, GROUP)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    rows = offs_m.to(tl.int64)[:, None]
    scale_2 = tl.load(s2_ptr)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + offs_k
        x = tl.load(
            x_ptr + rows * stride_xm + cols[None, :], mask=(offs_m[:, None] < M) & (cols[None, :] < K), other=0.0
        )
        w = _weight_tile(
            q_ptr, s_ptr, scale_2, offs_n, k0, N, K, stride_qn, stride_sn, x.dtype, INTERPRETED, BLOCK_N, BLOCK_K
        )
        acc = _dot(x, tl.trans(w), acc, PRECISION, INTERPRETED)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    y = _cast(acc, y_ptr.dtype.element_ty, INTERPRETED)
    tl.store(y_ptr + rows * stride_ym + offs_n[None, :], y, mask=mask)


@_tuned
@triton.jit
def _input_grad_kernel(
    dy_ptr, q_ptr, s_ptr, s2_ptr, dx_ptr, M, N, K, stride_dym, stride_qn, stride_sn, stride_dxm, M_BUCKET,
    PRECISION: tl.constexpr, INTERPRETED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
):  # fmt: skip
    """dx [M, K] = dy [M, N] @ deq(W), one [BLOCK_M, BLOCK_K] tile per program, summed over N in fp32."""
    pid_m, pid_k = _tile_ids(M, K, BLOCK_M, BLOCK_K, GROUP)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    k0 = pid_k * BLOCK_K
    offs_k = k0 + tl.arange(0, BLOCK_K)
    rows = offs_m.to(tl.int64)[:, None]
    scale_2 = tl.load(s2_ptr)
    acc = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
    for n0 in range(0, N, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        in_dy = (offs_m[:, None] < M) & (offs_n[None, :] < N)
        dy = tl.load(dy_ptr + rows * stride_dym + offs_n[None, :], mask=in_dy, other=0.0)
        w = _weight_tile(
            q_ptr, s_ptr, scale_2, offs_n, k0, N, K, stride_qn, stride_sn, dy.dtype, INTERPRETED, BLOCK_N, BLOCK_K
        )
        acc = _dot(dy, w, acc, PRECISION, INTERPRETED)
    mask = (offs_m[:, None] < M) & (offs_k[None, :] < K)
    dx = _cast(acc, dx_ptr.dtype.element_ty, INTERPRETED)
    tl.store(dx_ptr + rows * stride_dxm + offs_k[None, :], dx, mask=mask)


def blocks_for(m: int, dtype: torch.dtype) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) for `m` activation rows where nothing is timed (the
    interpreter): small tiles for few rows, and fp32's smaller ones (its exact products run on the CUDA cores)."""
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    if dtype == torch.float32:
        return block_m, 64, 32, 4, 2
    return block_m, 64, 64, 4, 2


def _checked(a: torch.Tensor, weight: NVFP4Tensor, width: int, what: str) -> torch.Tensor:
    """`a` as [rows, width] with a contiguous last dimension, after checking it fits the weight and the kernels."""
    if a.dtype not in DTYPES:
        raise TypeError(f"the Triton NVFP4 kernels take bf16, fp16 or fp32 activations; {what} is {a.dtype}.")
    if a.shape[-1:] != (width,):
        raise ValueError(
            f"{what} of shape {tuple(a.shape)} does not fit an NVFP4 weight of shape {tuple(weight.shape)}"
        )
    if a.device != weight.qdata.device:
        raise ValueError(f"{what} is on {a.device} but the NVFP4 weight is on {weight.qdata.device}; move one of them")
    a = a.reshape(-1, width)
    return a if a.stride(-1) == 1 else a.contiguous()  # the kernels step along a row by 1, whatever M is


def _launch(kernel, a: torch.Tensor, weight: NVFP4Tensor, out_cols: int, blocks, columns_by_k: bool) -> torch.Tensor:
    """Run `kernel` on `a` [M, width] into a new [M, out_cols] tensor; its output columns are tiled by BLOCK_K
    (`columns_by_k`, the input gradient) or by BLOCK_N (the forward)."""
    n, k = weight.shape
    m = a.shape[0]
    out = torch.empty(m, out_cols, dtype=a.dtype, device=a.device)
    if out.numel() == 0:
        return out
    if a.shape[1] == 0:
        return out.zero_()
    qdata = weight.qdata if weight.qdata.stride(-1) == 1 else weight.qdata.contiguous()
    scale = weight.scale.view(torch.uint8)
    scale = scale if scale.stride(-1) == 1 else scale.contiguous()
    scale_2 = weight.scale_2.to(device=a.device, dtype=torch.float32)

    def grid(meta):
        return (
            triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(out_cols, meta["BLOCK_K" if columns_by_k else "BLOCK_N"]),
        )

    args = (a, qdata, scale, scale_2, out, m, n, k, a.stride(0), qdata.stride(0), scale.stride(0), out.stride(0),
            _rows_bucket(m))  # fmt: skip
    common = {"PRECISION": "ieee" if a.dtype == torch.float32 else "tf32", "GROUP": GROUP_M,
              "INTERPRETED": a.is_cpu}  # a CPU tensor: under TRITON_INTERPRET=1  # fmt: skip
    with torch.cuda.device(a.device) if a.is_cuda else contextlib.nullcontext():
        if blocks is None and not a.is_cpu:
            kernel[grid](*args, **common)  # autotuned
        else:
            block_m, block_n, block_k, warps, stages = blocks or blocks_for(m, a.dtype)
            kernel.fn[grid](*args, **common, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps,
                            num_stages=stages)  # fmt: skip
    return out


def forward(x: torch.Tensor, weight: NVFP4Tensor, blocks: tuple[int, ...] | None = None) -> torch.Tensor:
    """`x [..., K] @ deq(W).T` -> [..., N] in x's dtype. `blocks` (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)
    fixes the tiles instead of the tuner (BLOCK_K a multiple of 16, each a power of two)."""
    n, k = weight.shape
    a = _checked(x, weight, k, "x")
    return _launch(_forward_kernel, a, weight, n, blocks, False).reshape(*x.shape[:-1], n)


def input_grad(dy: torch.Tensor, weight: NVFP4Tensor, blocks: tuple[int, ...] | None = None) -> torch.Tensor:
    """`dy [..., N] @ deq(W)` -> [..., K] in dy's dtype; `blocks` as in `forward`."""
    n, k = weight.shape
    a = _checked(dy, weight, n, "dy")
    return _launch(_input_grad_kernel, a, weight, k, blocks, True).reshape(*dy.shape[:-1], k)
