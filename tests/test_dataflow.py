"""FrozenLinear: the three frozen-weight products from one packed NVFP4 weight through one dequantizer."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from optimum_pact.backends import get_backend
from optimum_pact.backends.torch_backend import TorchBackend
from optimum_pact.dataflow import FrozenLinear


def _pair(in_features=96, out_features=80, bias=True, dtype=torch.float32, tile_size=None, seed=0):
    torch.manual_seed(seed)
    linear = torch.nn.Linear(in_features, out_features, bias=bias)
    return linear, FrozenLinear.from_linear(linear, backend=get_backend("torch", tile_size=tile_size))


def _fwd_bwd(fn, x, grad):
    x = x.detach().clone().requires_grad_()
    y = fn(x)
    y.backward(grad)
    return y.detach(), x.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [True, False])
def test_forward_and_input_grad_equal_dense_reference_exactly(dtype, bias):
    _, layer = _pair(bias=bias)
    x = torch.randn(3, 7, 96, dtype=dtype)
    grad = torch.randn(3, 7, 80, dtype=dtype)
    w = layer.dequantize(dtype)
    b = None if layer.bias is None else layer.bias.to(dtype)
    y, dx = _fwd_bwd(layer, x, grad)
    # the bias is added after the product (F.linear(x, w, b) would fuse it into one rounding)
    y_ref, dx_ref = _fwd_bwd(lambda t: F.linear(t, w) if b is None else F.linear(t, w) + b, x, grad)
    assert y.dtype == dtype and dx.dtype == dtype
    torch.testing.assert_close(y, y_ref, atol=0, rtol=0)
    torch.testing.assert_close(dx, dx_ref, atol=0, rtol=0)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("tile_size", [16, 48, 64])
def test_tiled_products_agree_with_untiled(dtype, tol, tile_size):
    _, whole = _pair(in_features=256, out_features=192)
    _, tiled = _pair(in_features=256, out_features=192, tile_size=tile_size)
    assert torch.equal(whole.weight, tiled.weight)
    x, grad = torch.randn(33, 256, dtype=dtype), torch.randn(33, 192, dtype=dtype)
    y, dx = _fwd_bwd(whole, x, grad)
    y_t, dx_t = _fwd_bwd(tiled, x, grad)
    torch.testing.assert_close(y_t, y, atol=tol, rtol=tol)
    torch.testing.assert_close(dx_t, dx, atol=tol, rtol=tol)


class _CountingBackend(TorchBackend):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.calls = {"forward": 0, "input_grad": 0}

    def forward(self, x, handle):
        self.calls["forward"] += 1
        return super().forward(x, handle)

    def input_grad(self, dy, handle):
        self.calls["input_grad"] += 1
        return super().input_grad(dy, handle)


def test_checkpoint_recomputation_is_the_third_product():
    linear, _ = _pair()
    backend = _CountingBackend()
    layer = FrozenLinear.from_linear(linear, backend=backend)
    x, grad = torch.randn(5, 96), torch.randn(5, 80)
    y, dx = _fwd_bwd(lambda t: checkpoint(lambda u: torch.tanh(layer(u)), t, use_reentrant=False), x, grad)
    assert backend.calls == {"forward": 2, "input_grad": 1}  # forward, recomputation, input gradient
    y_ref, dx_ref = _fwd_bwd(lambda t: torch.tanh(layer(t)), x, grad)
    torch.testing.assert_close(dx, dx_ref, atol=0, rtol=0)


def test_nothing_floating_of_weight_size_is_saved_for_backward():
    _, layer = _pair(in_features=160, out_features=128)
    saved = []

    def pack(t):
        saved.append(t)
        return t

    x = torch.randn(2, 3, 160, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = layer(x)
    y.sum().backward()
    weight_numel = 128 * 160
    assert not [t for t in saved if t.is_floating_point() and t.numel() >= weight_numel], [t.shape for t in saved]
    # and the module itself holds no floating weight, only the packed one
    floats = [n for n, t in layer.state_dict().items() if t.is_floating_point() and t.numel() >= weight_numel]
    assert floats == []


def test_no_input_grad_when_input_does_not_require_it():
    backend = _CountingBackend()
    layer = FrozenLinear.from_linear(torch.nn.Linear(32, 16), backend=backend)
    layer(torch.randn(4, 32)).sum()
    assert backend.calls["input_grad"] == 0


def test_state_dict_round_trip_and_modelopt_names():
    _, layer = _pair()
    sd = layer.state_dict()
    assert {k: v.dtype for k, v in sd.items()} == {
        "weight": torch.uint8,
        "weight_scale": torch.float8_e4m3fn,
        "weight_scale_2": torch.float32,
        "bias": torch.float32,
    }
    fresh = FrozenLinear(96, 80)
    x = torch.randn(4, 96)
    fresh(x)  # prepares a handle on the empty weight; loading must invalidate it
    fresh.load_state_dict(sd)
    torch.testing.assert_close(fresh(x), layer(x), atol=0, rtol=0)


def test_moving_dtype_of_bias_keeps_packed_weight():
    _, layer = _pair()
    before = layer.dequantize()
    layer.to(torch.bfloat16)
    assert torch.equal(layer.dequantize(), before)
    assert layer.weight.dtype == torch.uint8 and layer.weight_scale.dtype == torch.float8_e4m3fn
    assert layer(torch.randn(2, 96, dtype=torch.bfloat16)).dtype == torch.bfloat16


def test_clear_errors():
    with pytest.raises(ValueError, match="multiple of 16.*exclude it from target_modules"):
        FrozenLinear.from_linear(torch.nn.Linear(40, 16))
    with pytest.raises(ValueError, match="Unknown backend 'npu'.*'torch'"):
        get_backend("npu")
    with pytest.raises(ValueError, match="tile_size"):
        get_backend("torch", tile_size=10)
    with pytest.raises(TypeError, match="backend instance"):
        FrozenLinear.from_linear(torch.nn.Linear(32, 16), backend="torch")


# ---------------------------------------------------------------- a state dict that would load garbage is refused


def _packed_state(**edits):
    """A FrozenLinear(96 -> 80)'s state dict inside a Sequential (prefix "0."), with `edits` applied (None drops)."""
    _, layer = _pair()
    state = {f"0.{k}": v.clone() for k, v in layer.state_dict().items()}
    for name, value in edits.items():
        if value is None:
            del state[f"0.{name}"]
        else:
            state[f"0.{name}"] = value(state[f"0.{name}"])
    return state


@pytest.mark.parametrize("strict", [True, False])
def test_state_dict_missing_a_packed_tensor_is_refused_naming_it(strict):
    fresh = torch.nn.Sequential(FrozenLinear(96, 80))
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with pytest.raises(ValueError) as info:
        fresh.load_state_dict(_packed_state(weight_scale=None, weight_scale_2=None), strict=strict)
    message = str(info.value)
    assert "0.weight_scale: missing from the state dict" in message, message
    assert "0.weight_scale_2: missing from the state dict" in message, message
    assert "0.weight:" not in message  # only what is wrong
    # nothing of the half weight was copied in (strict=False used to mix the new codes with the old scales)
    bits = {k: v.reshape(-1).view(torch.uint8) for k, v in fresh.state_dict().items()}
    assert all(torch.equal(bits[k], v.reshape(-1).view(torch.uint8)) for k, v in before.items())
    # a state dict holding none of the layer's frozen weight still loads partially when strict=False
    fresh.load_state_dict({"0.bias": torch.ones(80)}, strict=False)
    assert torch.equal(fresh[0].bias, torch.ones(80))


@pytest.mark.parametrize(
    ("edits", "problem"),
    [
        ({"weight_scale": lambda t: t.half()}, "0.weight_scale: dtype torch.float16, must be torch.float8_e4m3fn"),
        ({"weight": lambda t: t.float()}, "0.weight: dtype torch.float32, must be torch.uint8"),
        ({"weight_scale": lambda t: t[:, :5].contiguous()}, "0.weight_scale: shape [80, 5], must be [80, 6]"),
        ({"weight_scale_2": lambda t: torch.zeros(())}, "0.weight_scale_2: 0.0, must be a finite number > 0"),
        ({"weight_scale_2": lambda t: t / 0}, "0.weight_scale_2: inf, must be a finite number > 0"),
        ({"weight_scale": lambda t: torch.full_like(t.view(torch.uint8), 0x7F).view(t.dtype)}, "480 of 480 block"),
    ],
)
def test_state_dict_with_a_wrong_packed_tensor_is_refused_naming_it(edits, problem):
    fresh = torch.nn.Sequential(FrozenLinear(96, 80))
    with pytest.raises(ValueError) as info:
        fresh.load_state_dict(_packed_state(**edits))
    assert problem in str(info.value), str(info.value)
    assert "FrozenLinear" in str(info.value)
