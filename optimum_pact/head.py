"""The output head at inference: its input with plain strides, and decoding's few rows in one native pass.

Plain strides: transformers computes the logits of generation's prompt as `lm_head(hidden_states[:, -1:, :])`: a
[1, 1, hidden] slice that is contiguous by torch's rule but keeps the prompt's batch stride. torch 2.13's CPU linear
sends such an input down a slow path: for Qwen2.5-Coder-1.5B's bf16 head (151936 x 1536), 1.8-2.1 s and a 0.44 GiB
transient per call, against 0.05 s and none for the same values with plain strides (measured 2026-12-07, 2-core AMD
EPYC, AVX-512 with AVX512-BF16). A view with the same shape gives plain strides and copies nothing.

One pass: a decoding step multiplies one row by the whole head, the largest weight of a small model (SmolLM2-135M's
tied 49152 x 576, 113 MB in fp32), so the step is bound by how fast the head is read. torch 2.13's fp32 product of one
row read it at half the memory's speed: 16.2 ms against 7.5 ms for `weight.sum()` on a 2-core AVX2-only AMD EPYC
(2026-12-07). `head_product` runs those rows through the native kernel's dense mode instead (`NativeLinear`: fp32
sums, one rounding into x's dtype; the same rounding contract as the fused linears). The quick path
(`optimum_pact.decoder`) and a PACT-loaded model's head (`prepare_head`) both call it, so they give the same logits bit
for bit; training and rows past `FUSED_MAX_ROWS` keep torch's product.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .backends.torch_backend import fusable
from .nvfp4.kernels import NativeLinear, native_available

_BOUND = "_pact_native_head"  # where head_product keeps the head it bound, on the caller's holder


def _fusable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """The backend's decoding rows (`fusable`: inference, few CPU rows in a dtype the kernel reads) against a CPU
    weight [n, k] of x's dtype that the dense mode reads (k a multiple of 16)."""
    k = weight.shape[-1]
    return (
        weight.is_cpu
        and weight.dim() == 2
        and x.dtype == weight.dtype
        and x.shape[-1] == k
        and k % 16 == 0
        and fusable(x, k)
        and native_available()
    )


def head_product(x: torch.Tensor, weight: torch.Tensor, holder: object) -> torch.Tensor:
    """`F.linear(x, weight)`; at inference on a few CPU rows in the weight's dtype, through the native kernel's dense
    mode. The bound kernel is kept on `holder` (the head module, the decoder) and bound again when the weight
    changes (another tensor, or written in place)."""
    if not _fusable(x, weight):
        return F.linear(x, weight)
    key = (weight.data_ptr(), weight._version, tuple(weight.shape), weight.stride(), weight.dtype)
    bound = holder.__dict__.get(_BOUND)
    if bound is None or bound[0] != key:
        bound = holder.__dict__[_BOUND] = (key, NativeLinear(weight.detach()))
    return bound[1].run(x)


def _plain_strides(module: nn.Module, args: tuple):
    x = args[0] if args else None
    if x is None or not x.is_contiguous() or x.dim() < 3:
        return None
    return (x.view(x.shape), *args[1:])  # a contiguous tensor's view: plain strides, the same storage


def _head_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, self.weight, self.bias) if self.bias is not None else head_product(x, self.weight, self)


def prepare_head(model: nn.Module) -> nn.Module:
    """Give `model`'s output head (`get_output_embeddings()`, an `nn.Linear`) its input with plain strides and
    decoding's rows through `head_product` from now on; returns the model. The module stays an `nn.Linear` whose
    weight is what it was (tied embeddings stay tied); its forward is set on the instance, as accelerate's hooks do."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if isinstance(head, nn.Linear) and _plain_strides not in head._forward_pre_hooks.values():
        head.register_forward_pre_hook(_plain_strides)
        head.forward = _head_forward.__get__(head)
    return model


__all__ = ["head_product", "prepare_head"]
