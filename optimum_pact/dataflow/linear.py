"""FrozenLinear: a linear layer whose frozen weight lives once, packed as NVFP4, behind a backend."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..backends import Backend, get_backend
from ..nvfp4 import NVFP4Tensor, quantize
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


class FrozenProduct(torch.autograd.Function):
    """`x @ deq(W).T` whose backward is `dy @ deq(W)` from the same packed weight and dequantizer.

    Nothing is saved for backward: the input gradient needs only `dy` and the resident packed weight,
    and the weight is frozen, so there is no weight gradient. Under activation checkpointing the
    forward runs again in backward: that recomputation is the third frozen product.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, backend: Backend, handle: Any) -> torch.Tensor:
        ctx.backend, ctx.handle = backend, handle
        return backend.forward(x, handle)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        if not ctx.needs_input_grad[0]:
            return None, None, None
        return ctx.backend.input_grad(dy.contiguous(), ctx.handle), None, None


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

        `backend` is the model's one backend instance (None: a new torch backend, for a layer used alone).
        """
        layer = cls.empty_like(linear, backend=backend, precision=precision)
        if precision == "fp16":
            layer.weight.copy_(linear.weight.detach())
        else:
            layer.load_nvfp4(quantize(linear.weight.detach()))
        if linear.bias is not None:
            layer.bias.data.copy_(linear.bias.detach())
        return layer

    @property
    def nvfp4(self) -> NVFP4Tensor:
        if self.precision != "nvfp4":
            raise AttributeError(f"this FrozenLinear holds a {self.precision} weight, not NVFP4.")
        return NVFP4Tensor(self.weight, self.weight_scale, self.weight_scale_2)

    def load_nvfp4(self, weight: NVFP4Tensor) -> None:
        if self.precision != "nvfp4":
            raise ValueError(f"load_nvfp4 on a FrozenLinear with precision={self.precision!r}.")
        if weight.shape != (self.out_features, self.in_features):
            raise ValueError(f"NVFP4 weight of shape {tuple(weight.shape)} does not fit {self}.")
        self.weight, self.weight_scale, self.weight_scale_2 = weight.qdata, weight.scale, weight.scale_2
        self._handle = None

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

    def _load_from_state_dict(self, *args, **kwargs):
        self._handle = None
        return super()._load_from_state_dict(*args, **kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = FrozenProduct.apply(x, self.backend, self.handle)
        return out if self.bias is None else out + self.bias.to(out.dtype)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"format={self.precision}, backend={self.backend.name}"
        )
