"""The torch backend: the reference path and the fast CPU path; on CUDA, the Triton NVFP4 kernels where triton is
installed (`triton_dispatch.py`), plain torch ops otherwise."""

from __future__ import annotations

import threading
from collections import Counter

import torch

from ..nvfp4 import NVFP4Tensor, dequantize
from ..nvfp4.kernels import NativeLinear, native_available
from ..precision import native_bf16
from .triton_dispatch import runs_on_triton, triton_product

# Rows up to which inference (no autograd) runs the fused product; training keeps the dequantize-then-multiply path,
# so forward, recomputation and input gradient always see the same effective weights in the same dtype.
FUSED_MAX_ROWS = 8
FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _native_weight(handle: NVFP4Tensor | torch.Tensor) -> bool:
    """Whether the native kernel reads this weight: packed, or 16-bit (a layer kept 16-bit), on the CPU."""
    if isinstance(handle, NVFP4Tensor):
        return handle.qdata.is_cpu
    return handle.is_cpu and handle.dtype in (torch.bfloat16, torch.float16) and handle.dim() == 2


def fusable(x: torch.Tensor, k: int) -> bool:
    """Whether the fused product takes `x` against a weight with `k` inputs: inference (no autograd) on at most
    FUSED_MAX_ROWS rows of a CPU tensor in a dtype the kernel reads."""
    return not torch.is_grad_enabled() and x.is_cpu and x.dtype in FUSED_DTYPES and x.numel() <= FUSED_MAX_ROWS * k


# A dequantized weight (or tile) up to this size is written into a buffer kept per thread and dtype and reused by
# the next product, instead of a new allocation per call: a training step makes several hundred, which either fault
# in fresh pages each time (glibc's threshold pinned, see optimum_pact.memory.allocator) or fragment glibc's heap.
# Larger ones (an untied output head) are allocated per call, so the kept buffer stays one layer's size.
SCRATCH_MAX_BYTES = 64 * 2**20


class _Scratch(threading.local):
    def __init__(self):
        self.buffers: dict[torch.dtype, torch.Tensor] = {}


_SCRATCH = _Scratch()


def _scratch(shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor | None:
    """This thread's reusable buffer viewed as a contiguous `shape` tensor, or None where it would be too large."""
    numel = shape[0] * shape[1]
    if numel * dtype.itemsize > SCRATCH_MAX_BYTES:
        return None
    buffer = _SCRATCH.buffers.get(dtype)
    if buffer is None or buffer.numel() < numel:
        buffer = _SCRATCH.buffers[dtype] = torch.empty(numel, dtype=dtype)
    return buffer[:numel].view(shape)


def _dequantize(qdata: torch.Tensor, scale: torch.Tensor, scale_2: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`dequantize`, into this thread's scratch buffer on the CPU: valid until this thread's next call."""
    out = _scratch((qdata.shape[0], qdata.shape[1] * 2), dtype) if qdata.is_cpu else None
    return dequantize(qdata, scale, scale_2, dtype, out=out)


def _matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`a @ b`; 16-bit CPU operands of more than 2 rows without native bf16 are multiplied in fp32 and the result
    rounded once into a's dtype. Torch emulates the 16-bit product there (AVX2 CPUs): a bf16 [64, 576] @ [576, 1536]
    took 7.0 ms against 1.3 ms this way on an AVX2-only AMD EPYC; at 1 row the bf16 product was the faster. The
    operands are 16-bit values, so their products are exact in fp32 and the sums run in fp32, as a native bf16
    product's do: the same result up to summation order, from the same effective weights."""
    if a.dtype in (torch.bfloat16, torch.float16) and a.is_cpu and a.numel() > 2 * a.shape[-1] and not native_bf16():
        return (a.float() @ b.float()).to(a.dtype)
    return a @ b


class TorchBackend:
    """Dequantizes the packed weight tile by tile and multiplies each tile at once.

    `tile_size` is the number of weight rows (forward) or columns (input gradient) dequantized at a time;
    `None` dequantizes the whole weight in one tile. On the CPU a tile is written into a buffer kept per thread and
    reused by the next product (`SCRATCH_MAX_BYTES`); its values never outlive the call.
    Forward tiles split the output features and input-gradient tiles split the input features, never the
    reduction. One tile equals a dense matmul against `deq(W)` bit for bit; smaller tiles agree with it up to
    the accumulation order the BLAS kernel picks for each tile shape.

    A 16-bit weight (a layer the precision plan keeps in fp16) is a plain tensor: no dequantization at all.
    Products run in the input's dtype with the BLAS kernel's fp32 accumulation, so no range guard is needed here
    (the NPU's fp16 graphs have one). `counts` tallies the products run (`forward`, `input_grad`).

    On CUDA an NVFP4 weight's products run in the Triton kernels instead (`triton_kernels.py`: each tile dequantized
    in registers, the same effective weights; `tile_size` does not apply), counted again as `triton_forward` and
    `triton_input_grad`; see `triton_dispatch.py` for when.
    """

    name = "torch"
    requested, reason = "torch", "requested"  # built directly; `get_backend` sets both on the instance
    runs_beside_cpu = False  # the products run on the CPU cores of the adapter path: overlapping them competes

    def __init__(self, tile_size: int | None = None):
        if tile_size is not None and (
            isinstance(tile_size, bool) or not isinstance(tile_size, int) or tile_size <= 0 or tile_size % 16
        ):
            raise ValueError(
                f"TorchBackend tile_size={tile_size!r} is invalid; pass None (the whole weight at once) "
                "or a positive multiple of 16 (the NVFP4 block size), e.g. 256."
            )
        self.tile_size = tile_size
        self.counts: Counter[str] = Counter()

    def dense_weight_dtype(self, source_dtype: torch.dtype) -> torch.dtype:
        """bf16 stays bf16 (the faster CPU format); every other source is stored in fp16."""
        return torch.bfloat16 if source_dtype == torch.bfloat16 else torch.float16

    def prepare(self, weight: NVFP4Tensor | torch.Tensor) -> NVFP4Tensor | torch.Tensor:
        return weight

    def forward(self, x: torch.Tensor, handle: NVFP4Tensor | torch.Tensor) -> torch.Tensor:
        self.counts["forward"] += 1
        return self._forward(x, handle)

    def input_grad(self, dy: torch.Tensor, handle: NVFP4Tensor | torch.Tensor) -> torch.Tensor:
        self.counts["input_grad"] += 1
        return self._input_grad(dy, handle)

    def bind_lora(
        self, handle: NVFP4Tensor | torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float
    ) -> FusedLora | None:
        """The fused decoding product of `handle` (packed, or a layer kept 16-bit) and this adapter as its tensors are
        now (see `FusedLora`), or None where there is none (a weight off the CPU, the native kernel unavailable)."""
        if not _native_weight(handle) or not native_available():
            return None
        return FusedLora(self, handle, (lora_a, lora_b, scaling))

    @staticmethod
    def native_linear(handle: NVFP4Tensor) -> NativeLinear:
        """The fused product of `handle` alone, bound on first use and kept on the handle."""
        native = handle.__dict__.get("_native_linear")
        if native is None:
            native = handle.__dict__["_native_linear"] = NativeLinear(handle.qdata, handle.scale, handle.scale_2)
        return native

    @staticmethod
    def _fused(x: torch.Tensor, handle: NVFP4Tensor | torch.Tensor) -> bool:
        """Inference (no autograd) on a few rows of an NVFP4 weight on the CPU, i.e. decoding: one pass over the
        packed weight, fp32 sums, never a dequantized weight in memory."""
        if not isinstance(handle, NVFP4Tensor) or not handle.qdata.is_cpu:
            return False
        k = handle.shape[1]  # x of another width goes on to the matmul, which says what does not fit
        return x.shape[-1] == k and fusable(x, k) and native_available()

    def _forward(self, x: torch.Tensor, handle: NVFP4Tensor | torch.Tensor) -> torch.Tensor:
        if isinstance(handle, torch.Tensor):  # a layer kept 16-bit: fused only with its adapter (`bind_lora`)
            return _matmul(x, handle.to(x.dtype).t())
        if runs_on_triton(x, handle) and (out := triton_product("forward", x, handle)) is not None:
            self.counts["triton_forward"] += 1
            return out
        n, k = handle.shape
        if self._fused(x, handle):
            return self.native_linear(handle).run(x)
        tile = self.tile_size or n
        if tile >= n:
            return _matmul(x, _dequantize(handle.qdata, handle.scale, handle.scale_2, x.dtype).t())
        out = x.new_empty(*x.shape[:-1], n)
        for n0 in range(0, n, tile):
            rows = slice(n0, n0 + tile)
            w = _dequantize(handle.qdata[rows], handle.scale[rows], handle.scale_2, x.dtype)
            out[..., rows] = _matmul(x, w.t())
        return out

    def _input_grad(self, dy: torch.Tensor, handle: NVFP4Tensor | torch.Tensor) -> torch.Tensor:
        if isinstance(handle, torch.Tensor):
            return _matmul(dy, handle.to(dy.dtype))
        if runs_on_triton(dy, handle) and (out := triton_product("input_grad", dy, handle)) is not None:
            self.counts["triton_input_grad"] += 1
            return out
        n, k = handle.shape
        tile = self.tile_size or k
        if tile >= k:
            return _matmul(dy, _dequantize(handle.qdata, handle.scale, handle.scale_2, dy.dtype))
        out = dy.new_empty(*dy.shape[:-1], k)
        for k0 in range(0, k, tile):
            cols = slice(k0, k0 + tile)
            packed, scales = slice(k0 // 2, (k0 + tile) // 2), slice(k0 // 16, (k0 + tile) // 16)
            w = _dequantize(handle.qdata[:, packed], handle.scale[:, scales], handle.scale_2, dy.dtype)
            out[..., cols] = _matmul(dy, w)
        return out


class FusedLora:
    """`x @ deq(W).T + scaling * (x @ A.T) @ B.T` in ONE native pass for the x it fuses (inference, a few rows on the
    CPU: decoding), with a single rounding into x's dtype; None for any other x (the caller runs the two apart).
    Bound to the adapter's tensors as they are when built: rebuild it after changing them."""

    def __init__(
        self, backend: TorchBackend, handle: NVFP4Tensor | torch.Tensor, lora: tuple[torch.Tensor, torch.Tensor, float]
    ):
        packed = (handle.qdata, handle.scale, handle.scale_2) if isinstance(handle, NVFP4Tensor) else (handle,)
        self.backend, self.native = backend, NativeLinear(*packed, lora=lora)
        self.n, self.k = self.native.n, self.native.k

    def __call__(self, x: torch.Tensor) -> torch.Tensor | None:
        k = self.k
        if not fusable(x, k):
            return None
        if x.shape[-1] != k:
            raise ValueError(f"x of shape {tuple(x.shape)} does not fit an NVFP4 weight of shape {(self.n, k)}")
        self.backend.counts["forward"] += 1
        return self.native.run(x)
