"""FrozenLinear: a linear layer whose frozen weight lives once, packed as NVFP4, behind a backend."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ..backends import Backend, get_backend
from ..nvfp4 import NVFP4Tensor, quantize
from ..pages import release_clean_pages
from ..precision.plan import PRECISIONS

PACKED_NAMES = ("weight", "weight_scale", "weight_scale_2")  # ModelOpt checkpoint names


def _backend(backend: Backend | None) -> Backend:
    """`backend` itself, or a new torch backend for None (a layer used alone); anything else is a TypeError."""
    if backend is None:
        return get_backend("torch")
    if not isinstance(backend, Backend):
        raise TypeError(
            f"FrozenLinear backend={backend!r} must be a backend instance, e.g. optimum_pact.get_backend('torch'); "
            "build it once per model and pass it to every layer."
        )
    return backend


def streamed(product, stream, kind: str):
    """`product` (a backend's `forward` or `input_grad`) between the layer's `stream.before(kind)` and
    `stream.after(kind)` (optimum_pact.memory.WeightStream: the mapped weight released after use), or `product`
    itself for a layer that is not streamed."""
    if stream is None:
        return product

    def run(x, handle):
        stream.before(kind)
        try:
            return product(x, handle)
        finally:
            stream.after(kind)

    return run


class FrozenProduct(torch.autograd.Function):
    """`x @ deq(W).T` whose backward is `dy @ deq(W)` from the same packed weight and dequantizer.

    Nothing is saved for backward: the input gradient needs only `dy` and the resident packed weight,
    and the weight is frozen, so there is no weight gradient. Under activation checkpointing the
    forward runs again in backward: that recomputation is the third frozen product.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, backend: Backend, handle: Any, stream: Any = None) -> torch.Tensor:
        ctx.backend, ctx.handle, ctx.stream = backend, handle, stream
        return streamed(backend.forward, stream, "forward")(x, handle)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        return (
            streamed(ctx.backend.input_grad, ctx.stream, "input_grad")(dy.contiguous(), ctx.handle),
            None,
            None,
            None,
        )


class FrozenLinear(nn.Module):
    """A frozen `nn.Linear` stored as NVFP4 (ModelOpt names: `weight`, `weight_scale`, `weight_scale_2`).

    Use `FrozenLinear.from_linear(linear)`; the state dict is the ModelOpt checkpoint layout, so a saved model
    reloads without quantizing again. The bias, if any, stays in the layer's dtype.

    `precision="fp16"` keeps the weight 16-bit instead (a layer the precision plan found sensitive): one dense
    `weight` buffer, no dequantization, the same backend products. It is fp16, or bf16 when the source layer is
    bf16 and the backend is torch (bf16 is the faster CPU format; the NPU computes in fp16).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        backend: Backend | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        precision: str = "nvfp4",
        weight_dtype: torch.dtype = torch.float16,
    ):
        super().__init__()
        if precision not in PRECISIONS:
            raise ValueError(f"FrozenLinear precision={precision!r} is not one of {PRECISIONS}.")
        if precision == "fp16" and weight_dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"FrozenLinear weight_dtype={weight_dtype} must be torch.float16 or torch.bfloat16.")
        if in_features % 16:
            raise ValueError(
                f"FrozenLinear needs in_features to be a multiple of 16; got {in_features}. "
                "Leave this layer unquantized (exclude it from target_modules)."
            )
        self.in_features, self.out_features, self.precision = in_features, out_features, precision
        self._dense_dtype = weight_dtype  # the fp16-precision weight's dtype (NVFP4 layers keep their own)
        if precision == "fp16":
            self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=weight_dtype, device=device))
        else:
            self.register_buffer(
                "weight", torch.zeros(out_features, in_features // 2, dtype=torch.uint8, device=device)
            )
            self.register_buffer(
                "weight_scale", torch.ones(out_features, in_features // 16, dtype=torch.float8_e4m3fn, device=device)
            )
            self.register_buffer("weight_scale_2", torch.ones((), dtype=torch.float32, device=device))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device), False) if bias else None
        self.backend = _backend(backend)
        self._handle = None
        self.stream = None  # set by optimum_pact.memory.WeightStream while the mapped weight is streamed

    @classmethod
    def empty_like(cls, linear: nn.Linear, backend: Backend | None = None, precision: str = "nvfp4") -> FrozenLinear:
        """A FrozenLinear of `linear`'s shape, bias, dtype and device, with no weight loaded yet."""
        backend = _backend(backend)
        return cls(
            linear.in_features,
            linear.out_features,
            bias=linear.bias is not None,
            backend=backend,
            dtype=linear.weight.dtype,
            device=linear.weight.device,
            precision=precision,
            weight_dtype=backend.dense_weight_dtype(linear.weight.dtype),
        )

    @classmethod
    def from_linear(cls, linear: nn.Linear, backend: Backend | None = None, precision: str = "nvfp4") -> FrozenLinear:
        """Quantize `linear.weight` to NVFP4 (or cast it to 16 bits for `precision="fp16"`); no other copy is kept.

        When `linear.weight` is a view of a mapped checkpoint file (transformers maps one whose dtype matches the
        model's), the pages quantization read are handed back (`optimum_pact.pages.release_clean_pages`): unwritten
        file pages read back the same bytes if anything uses the weight again.

        `backend` is the model's one backend instance (None: a new torch backend, for a layer used alone).
        """
        layer = cls.empty_like(linear, backend=backend, precision=precision)
        if precision == "fp16":
            layer.weight.copy_(linear.weight.detach())
        else:
            layer.load_nvfp4(quantize(linear.weight.detach()))
        if linear.bias is not None:
            layer.bias.data.copy_(linear.bias.detach())
        release_clean_pages(linear.weight)  # a view of a mapped checkpoint would stay resident: see optimum_pact.pages
        return layer

    @property
    def nvfp4(self) -> NVFP4Tensor:
        if self.precision != "nvfp4":
            raise AttributeError(f"this FrozenLinear holds a {self.precision} weight, not NVFP4.")
        return NVFP4Tensor(self.weight, self.weight_scale, self.weight_scale_2)

    def load_nvfp4(self, weight: NVFP4Tensor) -> None:
        """Hold `weight` (its three tensors, not copies) and drop the backend's prepared handle; dtypes and shapes
        are checked, values are not (see `weight_problems`)."""
        if self.precision != "nvfp4":
            raise ValueError(f"load_nvfp4 on a FrozenLinear with precision={self.precision!r}.")
        tensors = dict(zip(PACKED_NAMES, (weight.qdata, weight.scale, weight.scale_2)))
        problems = self.weight_problems(tensors, values=False)
        if problems:
            raise ValueError(f"This NVFP4 weight does not fit {self}: {'; '.join(problems)}.")
        self.weight, self.weight_scale, self.weight_scale_2 = weight.qdata, weight.scale, weight.scale_2
        self._handle = None

    def release_handle(self) -> None:
        """Drop the backend's prepared weight; the next product prepares it again from the buffers. Call it after
        putting a new tensor in a buffer's place without `load_nvfp4` (e.g. a memory-mapped copy)."""
        self._handle = None

    def layout(self) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        """The frozen-weight tensors this layer holds, as a checkpoint or state dict must give them:
        `{name: (dtype, shape)}` (NVFP4: the ModelOpt names `weight`, `weight_scale`, `weight_scale_2`)."""
        n, k = self.out_features, self.in_features
        if self.precision == "fp16":
            return {"weight": (self._dense_dtype, (n, k))}
        return {
            "weight": (torch.uint8, (n, k // 2)),
            "weight_scale": (torch.float8_e4m3fn, (n, k // 16)),
            "weight_scale_2": (torch.float32, ()),
        }

    def weight_problems(
        self,
        tensors: Mapping[str, torch.Tensor | None],
        prefix: str = "",
        source: str = "the state dict",
        values: bool = True,
    ) -> list[str]:
        """Everything that keeps `tensors` (name -> tensor, None or absent: not given) from being this layer's frozen
        weight, one `"<prefix><name>: <problem>"` line each; empty when they fit.

        Checks that every tensor of `layout()` is there with its dtype and shape, and with `values` (not on the meta
        device) that `weight_scale_2` is a finite number > 0 and that no block scale is NaN: the values a packed
        weight can hold that are garbage whatever the codes.
        """
        problems = []
        for name, (dtype, shape) in self.layout().items():
            tensor, key = tensors.get(name), f"{prefix}{name}"
            if tensor is None:
                problems.append(f"{key}: missing from {source}")
            elif tensor.dtype != dtype:
                problems.append(f"{key}: dtype {tensor.dtype}, must be {dtype}")
            elif tuple(tensor.shape) != shape:
                problems.append(f"{key}: shape {list(tensor.shape)}, must be {list(shape)}")
            elif not values or tensor.is_meta:
                continue
            elif name == "weight_scale_2" and not (math.isfinite(value := float(tensor)) and value > 0):
                problems.append(f"{key}: {value}, must be a finite number > 0")
            elif name == "weight_scale" and (nan := int((tensor.view(torch.uint8) & 0x7F).eq(0x7F).sum())):
                problems.append(f"{key}: {nan} of {tensor.numel()} block scales are NaN")
        return problems

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The effective weight that every product uses (for merging and tests; never cached)."""
        if self.precision == "fp16":
            return self.weight.to(dtype)
        return self.nvfp4.dequantize(dtype)

    @property
    def handle(self) -> Any:
        if self._handle is None:
            self._handle = self.backend.prepare(self.weight if self.precision == "fp16" else self.nvfp4)
        return self._handle

    def _apply(self, fn, recurse=True):
        # `.to(dtype)` / `.half()` cast every floating buffer; the packed weight may move device but keeps its
        # dtypes (a bf16 scale_2 would change the effective weight).
        packed = {name: getattr(self, name) for name in PACKED_NAMES if hasattr(self, name)}
        super()._apply(fn, recurse)
        for name, before in packed.items():
            after = getattr(self, name)
            if after.dtype != before.dtype:
                setattr(self, name, before.to(after.device))
        self._handle = None  # prepare again on next use
        return self

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # torch would cast a tensor of the wrong dtype into the buffer and, with strict=False, load the codes
        # without their scales: either computes with garbage. So a state dict that gives any of the frozen weight
        # must give all of it, fit, before any of it is copied. One that gives none of it is torch's business:
        # listed as missing (an error when strict; torch passes strict=True here whatever the caller asked).
        given = {name: state_dict.get(prefix + name) for name in self.layout()}
        if any(tensor is not None for tensor in given.values()):
            problems = self.weight_problems(given, prefix)
            if problems:
                raise ValueError(
                    f"FrozenLinear {prefix[:-1] or '(the root module)'} cannot load this state dict; it would "
                    "compute with garbage:\n  - " + "\n  - ".join(problems) + "\nLoad the complete state dict of a "
                    "model with the same layers (its state_dict(), or the checkpoint save_pretrained wrote), or "
                    "build the layer again with FrozenLinear.from_linear."
                )
        self._handle = None
        return super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled():
            out = FrozenProduct.apply(x, self.backend, self.handle, self.stream)
        else:  # inference: the backend directly, without autograd's wrapper (decoding runs this 200+ times a token)
            out = streamed(self.backend.forward, self.stream, "forward")(x, self.handle)
        return out if self.bias is None else out + self.bias.to(out.dtype)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"format={self.precision}, backend={self.backend.name}"
        )
