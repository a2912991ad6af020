"""The output head at inference (optimum_pact/head.py): decoding's few rows through the native kernel's dense mode,
everything else through torch's product, and a bound head never stale."""

import shutil

import pytest
import torch
import torch.nn.functional as F

from optimum_pact.backends.torch_backend import FUSED_MAX_ROWS
from optimum_pact.head import head_product
from optimum_pact.nvfp4.kernels import NativeLinear

needs_native = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")


class Holder:
    pass


@pytest.fixture
def native_calls(monkeypatch) -> list:
    calls = []
    real = NativeLinear.run
    monkeypatch.setattr(NativeLinear, "run", lambda self, x: calls.append(tuple(x.shape)) or real(self, x))
    return calls


def _bound(got, x, w):
    """`got` is `x @ w.T` summed in fp32 and rounded once into x's dtype."""
    expected = x.double() @ w.double().T
    bound = 4 * x.shape[-1] * torch.finfo(torch.float32).eps * (x.abs().double() @ w.abs().double().T)
    bound = bound + torch.finfo(x.dtype).eps / 2 * (expected.abs() + bound)
    return ((got.double() - expected).abs() <= bound).all()


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, FUSED_MAX_ROWS])
def test_decoding_rows_go_through_the_native_kernel_with_fp32_sums(native_calls, dtype, rows):
    torch.manual_seed(rows)
    w, x = torch.randn(1000, 96).to(dtype), torch.randn(1, rows, 96).to(dtype)
    with torch.no_grad():
        got = head_product(x, w, Holder())
    assert native_calls == [(1, rows, 96)]
    assert got.dtype == dtype and got.shape == (1, rows, 1000)
    assert _bound(got[0], x[0], w)
    assert not _bound(got[0], x[0], w * 1.05)  # the check can fail: a weight 5% off is outside it


@needs_native
def test_training_and_longer_inputs_keep_torchs_product(native_calls):
    w = torch.randn(64, 32, requires_grad=True)
    x = torch.randn(1, 32)
    out = head_product(x, w, Holder())  # grad mode: torch, exactly, and the gradient flows
    assert torch.equal(out, F.linear(x, w))
    out.sum().backward()
    assert w.grad is not None
    with torch.no_grad():
        long = torch.randn(FUSED_MAX_ROWS + 1, 32)
        assert torch.equal(head_product(long, w, Holder()), F.linear(long, w))
        other = torch.randn(1, 32, dtype=torch.float64)  # a dtype the kernel does not read
        assert torch.equal(head_product(other, w.double(), Holder()), F.linear(other, w.double()))
    assert native_calls == []


@needs_native
def test_a_head_changed_in_place_or_replaced_is_bound_again():
    holder, w, x = Holder(), torch.randn(64, 32), torch.randn(1, 32)
    with torch.no_grad():
        first = head_product(x, w, holder)
        w.mul_(2)  # in place: same pointer, new version
        assert torch.equal(head_product(x, w, holder), first * 2)  # scaling by 2 is exact
        other = torch.randn(64, 32)
        assert _bound(head_product(x, other, holder), x, other)
