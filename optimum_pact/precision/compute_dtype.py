"""Which dtype to compute in when the user says "auto": for training, bf16 only where the CPU computes it natively.

Without AVX512-BF16 or AMX, torch's CPU bf16 matrix product runs an emulation far slower than fp32: on an AMD EPYC
with AVX2 only, 64 rows by a 1536 x 576 weight took 7.0 ms in bf16 and 1.2 ms in fp32. There fp32 is the fast
choice for training, and its memory cost in PACT is activations only: the frozen weights stay NVFP4 either way.
"""

from __future__ import annotations

import functools

import torch

DTYPES = ("auto", "bfloat16", "float32")


@functools.cache
def native_bf16() -> bool:
    """Whether torch's CPU kernels compute bf16 natively here (oneDNN's check: AVX512-BF16, AMX or the like)."""
    check = getattr(getattr(torch.ops, "mkldnn", None), "_is_mkldnn_bf16_supported", None)
    try:
        return bool(check()) if check is not None else False
    except RuntimeError:  # a torch build without oneDNN
        return False


def resolve_dtype(name: str | torch.dtype, inference: bool = False) -> torch.dtype:
    """`"auto"`: bf16 where `native_bf16()`, else fp32; a dtype or its name: that dtype.

    `inference=True` (generation): `"auto"` is bf16 on every CPU. Decoding reads the frozen weights packed whatever the
    dtype, so the dtype sets the bytes of the output head and the KV cache read per token, which bf16 halves (the
    SmolLM2 head: 9-10 ms a token in fp32, 3.6-3.9 ms in bf16 on an AVX2-only AMD EPYC, `bench_decode.py`), and the
    torch backend multiplies a prompt's bf16 products in fp32 where bf16 is emulated."""
    if isinstance(name, torch.dtype):
        return name
    if name == "auto":
        return torch.bfloat16 if inference or native_bf16() else torch.float32
    if name not in DTYPES:
        raise ValueError(f"dtype={name!r} is not one of {', '.join(DTYPES)}")
    return getattr(torch, name)


__all__ = ["DTYPES", "native_bf16", "resolve_dtype"]
