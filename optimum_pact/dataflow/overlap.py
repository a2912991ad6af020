"""One LoRA layer as ONE autograd node; optionally the backend's frozen product beside the CPU's adapter path.

`LoraFrozenProduct` computes `base(x) + bias + (x @ A.T @ B.T) * scaling` (peft's vanilla LoRA, same dtypes and
rounding) and its backward. With `overlap`, in forward the backend's `x @ deq(W).T` is submitted to a worker thread
first, then the CPU computes the adapter product; in backward, the backend's `dy @ deq(W)` runs in the worker while
the CPU computes both adapter gradients and the adapter's input gradient. ONNX Runtime (and torch's kernels) release
the GIL, so the two really run at once. Without `overlap` (the torch backend: both would share the same cores) the
same products run one after the other: what it saves then is autograd's bookkeeping, one node per layer instead of
peft's several (casts, two products, the scaling, the sum, views). Nothing extra is saved for backward: `x` and
`x @ A.T` are what peft's own path saves for the adapter; layers fed the same `x` one after another (q, k and v; gate
and up) share its cast to the adapter's dtype, so that is cast and saved once instead of two or three times.
"""

from __future__ import annotations

import math
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from .linear import streamed

_executor: ThreadPoolExecutor | None = None


def _worker() -> ThreadPoolExecutor:
    global _executor
    if _executor is None:
        _executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pact-backend")
    return _executor


class _Done:
    """A result computed already, read like a Future's."""

    def __init__(self, value):
        self.value = value

    def result(self):
        return self.value


def _run(overlap: bool, fn, *args):
    """`fn(*args)` in the backend's worker thread (a Future) with `overlap`, else now."""
    return _worker().submit(fn, *args) if overlap else _Done(fn(*args))


def _exact_scale(scaling: float) -> bool:
    """Whether multiplying by `scaling` is exact in any float format: a positive power of two (LoRA's alpha / r is
    usually 2)."""
    return scaling > 0 and math.frexp(scaling)[0] == 0.5


_last_cast: tuple | None = None  # (weakref to x, x's version, dtype, weakref to x.to(dtype)) of the latest cast


def _cast_once(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x.to(dtype)`, reused while the next layer is fed the same, unmodified `x` (its version counter unchanged) and
    the cast is still alive (saved by an earlier layer's node): the same bits, computed and held once. The cache holds
    nothing alive itself."""
    global _last_cast
    if x.dtype == dtype:
        return x
    last = _last_cast
    if last is not None and last[0]() is x and last[1] == x._version and last[2] == dtype:
        cast = last[3]()
        if cast is not None:
            return cast
    cast = x.to(dtype)
    _last_cast = (weakref.ref(x), x._version, dtype, weakref.ref(cast))
    return cast


class LoraFrozenProduct(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        x,
        lora_a,
        lora_b,
        scaling: float,
        backend,
        handle: Any,
        bias: torch.Tensor | None,
        stream=None,
        overlap: bool = True,
    ):
        base = _run(overlap, streamed(backend.forward, stream, "forward"), x.detach(), handle)
        xa = _cast_once(x, lora_a.dtype)
        h = xa @ lora_a.t()
        # `(h @ B.T) * s` as peft computes it; with s a power of two `(h * s) @ B.T` is the same bits (scaling by
        # 2**k is exact and commutes with every rounding) for an [..., r] multiply instead of an [..., out] one
        lora = (h * scaling) @ lora_b.t() if _exact_scale(scaling) else (h @ lora_b.t()) * scaling
        result = base.result()
        if bias is not None:
            result = result + bias.to(result.dtype)
        ctx.backend, ctx.handle, ctx.scaling, ctx.x_dtype, ctx.stream = backend, handle, scaling, x.dtype, stream
        ctx.overlap = overlap
        ctx.save_for_backward(xa, h, lora_a, lora_b)
        if lora.dtype == result.dtype:
            return lora.add_(result)
        if lora.dtype == torch.promote_types(lora.dtype, result.dtype):  # peft's sum in lora's dtype, rounded once
            return torch.add(result, lora, out=torch.empty_like(result))  # into result's: one pass, no fp32 tensor
        return (result + lora).to(result.dtype)

    @staticmethod
    def backward(ctx, dy):
        xa, h, lora_a, lora_b = ctx.saved_tensors
        dy = dy.contiguous()
        input_grad = streamed(ctx.backend.input_grad, ctx.stream, "input_grad")
        base = _run(ctx.overlap, input_grad, dy, ctx.handle) if ctx.needs_input_grad[0] else None
        scaling = ctx.scaling
        exact = _exact_scale(scaling)  # as in forward: then the scaling goes on the [..., r] and [out, r] products
        g = dy.to(lora_b.dtype) if exact else dy.to(lora_b.dtype) * scaling
        gh = (g @ lora_b).mul_(scaling) if exact else g @ lora_b  # [..., r]
        grad_b = None
        if ctx.needs_input_grad[2]:
            grad_b = g.reshape(-1, g.shape[-1]).t() @ h.reshape(-1, h.shape[-1])
            grad_b = grad_b.mul_(scaling) if exact else grad_b
        grad_a = gh.reshape(-1, gh.shape[-1]).t() @ xa.reshape(-1, xa.shape[-1]) if ctx.needs_input_grad[1] else None
        dx = None
        if base is not None:
            dx_lora = (gh @ lora_a).to(ctx.x_dtype)
            dx = base.result() + dx_lora
        return dx, grad_a, grad_b, None, None, None, None, None, None
