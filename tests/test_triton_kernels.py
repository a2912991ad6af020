"""The Triton NVFP4 kernels (optimum_pact.backends.triton_kernels), checked without a GPU: under Triton's interpreter
on CPU tensors, in a child process (TRITON_INTERPRET=1 is read when triton compiles, and the rest of the suite must
not see it).

The child runs this file as a script (`python tests/test_triton_kernels.py`, under both variables) and prints one
JSON line of measurements; the tests here assert on them. Each kernel is compared with the torch backend's reference
product (`dequantize_reference` cast to the activation dtype, multiplied in fp32, rounded once), within one rounding
of the activation dtype; its effective weights are compared with `dequantize` bit for bit; and the torch backend and
FrozenLinear are run through the same dispatch that CUDA tensors take.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed: pip install 'optimum-pact[gpu]'")

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# (M, N, K): none a multiple of the row / column tiles; K a multiple of 16 but not always of the K tile (32 or 64)
SHAPES = [(5, 40, 48), (33, 70, 96), (20, 130, 80), (3, 17, 160)]
SMALL_BLOCKS = (16, 16, 32, 4, 1)  # many tiles, partial ones at every edge; None: the GPU's own choice


def _excess(got: torch.Tensor, a: torch.Tensor, w: torch.Tensor) -> float:
    """max |got - ref| / bound for `got` = a @ w.T in a's dtype, where ref is the torch backend's reference product
    and bound is one rounding of that dtype at |ref| plus fp32 summation error: <= 1 means within one rounding."""
    ref = (a.float() @ w.float().T).to(a.dtype).double()
    scale = a.double().abs() @ w.double().abs().T
    bound = torch.finfo(a.dtype).eps * ref.abs() + a.shape[-1] * 2.0**-24 * scale + 1e-30
    return float(((got.double() - ref).abs() / bound).max())


def _numerics() -> dict:
    from optimum_pact.backends import triton_kernels as kernels
    from optimum_pact.nvfp4 import dequantize, dequantize_reference, quantize

    out = {}
    for m, n, k in SHAPES:
        torch.manual_seed(m * n + k)
        weight = quantize(torch.randn(n, k) * 0.1)
        if (m, n, k) == SHAPES[-1]:  # every e4m3 block scale but NaN: subnormal, zero and negative ones too
            codes = torch.randint(0, 254, weight.scale.shape, dtype=torch.int32)
            weight.scale = (codes + (codes >= 0x7F).int()).to(torch.uint8).view(torch.float8_e4m3fn)
        for name, dtype in DTYPES.items():
            w = dequantize_reference(weight.qdata, weight.scale, weight.scale_2, dtype)
            x, dy = torch.randn(m, k).to(dtype), torch.randn(m, n).to(dtype)
            for blocks in (SMALL_BLOCKS, None):
                case = f"{name} {m}x{n}x{k} blocks={blocks}"
                out[f"forward {case}"] = _excess(kernels.forward(x, weight, blocks), x, w)
                out[f"input_grad {case}"] = _excess(kernels.input_grad(dy, weight, blocks), dy, w.T)
            # leading dimensions, and a transposed (non-contiguous) x
            x3 = torch.randn(2, m, k).to(dtype)
            out[f"forward {name} {m}x{n}x{k} 3-d"] = _excess(kernels.forward(x3, weight).reshape(-1, n),
                                                             x3.reshape(-1, k), w)  # fmt: skip
            xt = torch.randn(k, m).to(dtype).T
            out[f"forward {name} {m}x{n}x{k} transposed x"] = _excess(kernels.forward(xt, weight), xt, w)
            # the effective weights: an identity's product is deq(W) itself, which must be `dequantize`'s exactly
            exact = dequantize(weight.qdata, weight.scale, weight.scale_2, dtype)
            eye_f = kernels.forward(torch.eye(k, dtype=dtype), weight)
            eye_g = kernels.input_grad(torch.eye(n, dtype=dtype), weight)
            out[f"weights {name} {m}x{n}x{k}"] = torch.equal(eye_f, exact.T) and torch.equal(eye_g, exact)
    return out


def _dispatch() -> dict:
    from optimum_pact.backends import triton_kernels as kernels
    from optimum_pact.backends.torch_backend import TorchBackend
    from optimum_pact.nvfp4 import quantize

    torch.manual_seed(0)
    weight = quantize(torch.randn(40, 48))
    x, dy = torch.randn(3, 5, 48, dtype=torch.bfloat16), torch.randn(3, 5, 40, dtype=torch.bfloat16)
    backend = TorchBackend(tile_size=16)  # tiles would split the CPU path; the kernels ignore them
    y, dx = backend.forward(x, weight), backend.input_grad(dy, weight)
    same = torch.equal(y, kernels.forward(x, weight)) and torch.equal(dx, kernels.input_grad(dy, weight))
    counts = dict(backend.counts)
    backend.forward(x.double(), weight)  # fp64: a dtype the kernels do not take
    backend.forward(x, weight.dequantize(torch.bfloat16))  # a 16-bit weight: no NVFP4 to read
    unsupported = dict(backend.counts)
    os.environ.pop("PACT_TRITON_INTERPRET")  # the interpreter alone does not send CPU tensors to the kernels
    backend.forward(x, weight), backend.input_grad(dy, weight)
    os.environ["PACT_TRITON_INTERPRET"] = "1"
    return {
        "same_as_kernels": same,
        "counts": counts,
        "unsupported": unsupported,
        "without_flag": dict(backend.counts),
    }


def _autograd() -> dict:
    from torch.utils.checkpoint import checkpoint

    from optimum_pact.backends import get_backend
    from optimum_pact.dataflow import FrozenLinear

    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 70, bias=False, dtype=torch.bfloat16)
    layer = FrozenLinear.from_linear(linear, backend=get_backend("torch"))
    x0, grad = torch.randn(2, 9, 96, dtype=torch.bfloat16), torch.randn(2, 9, 70, dtype=torch.bfloat16)

    def step():  # forward, its recomputation in backward (tanh saves its output), input gradient
        x = x0.clone().requires_grad_()
        y = checkpoint(lambda u: torch.tanh(layer(u)), x, use_reentrant=False)
        y.backward(grad)
        return y.detach(), x.grad

    y, dx = step()
    counts = dict(layer.backend.counts)
    os.environ.pop("PACT_TRITON_INTERPRET")
    y_cpu, dx_cpu = step()
    cpu_counts = dict(layer.backend.counts)
    os.environ["PACT_TRITON_INTERPRET"] = "1"
    with torch.no_grad():
        product = layer(x0)  # inference: the kernels alone, against the reference product
    return {
        "counts": counts,
        "cpu_counts": cpu_counts,
        "product_excess": _excess(product.reshape(-1, 70), x0.reshape(-1, 96), layer.dequantize(torch.bfloat16)),
        "y_vs_cpu": float((y.double() - y_cpu.double()).abs().max() / y_cpu.double().abs().max()),
        "dx_vs_cpu": float((dx.double() - dx_cpu.double()).abs().max() / dx_cpu.double().abs().max()),
    }


def _fallback() -> dict:
    import logging

    from optimum_pact.backends import triton_dispatch as dispatch
    from optimum_pact.backends.torch_backend import TorchBackend
    from optimum_pact.nvfp4 import dequantize_reference, quantize

    torch.manual_seed(0)
    weight = quantize(torch.randn(40, 48))
    x, dy = torch.randn(3, 48, dtype=torch.bfloat16), torch.randn(3, 40, dtype=torch.bfloat16)
    out = {"self_check": {str(dtype): dispatch.self_check(torch.device("cpu"), dtype) for dtype in DTYPES.values()}}
    row = torch.randn(48, 2).to(torch.bfloat16)[:, :1].T  # [1, K] whose elements are 2 apart in memory
    w = dequantize_reference(weight.qdata, weight.scale, weight.scale_2, torch.bfloat16)
    out["strided_row_excess"] = _excess(dispatch.kernels().forward(row, weight), row, w)
    os.environ["PACT_DISABLE_TRITON"] = "1"
    plain = TorchBackend()
    reference = plain.forward(x, weight), plain.input_grad(dy, weight)
    os.environ.pop("PACT_DISABLE_TRITON")
    warned = []
    handler = logging.Handler()
    handler.emit = lambda record: warned.append(record.getMessage())
    logging.getLogger(dispatch.__name__).addHandler(handler)

    def broken(*args, **kwargs):
        raise RuntimeError("PTX compile failed (a fault put here by the test)")

    kernels, real = dispatch.kernels(), dispatch.kernels().forward
    for fault, replacement in (("launch", broken), ("mismatch", lambda a, w: torch.zeros(a.shape[0], w.shape[0]))):
        dispatch._state.update(why=None, checked=set())
        kernels.forward = replacement
        backend = TorchBackend()
        got = backend.forward(x, weight), backend.input_grad(dy, weight), backend.forward(x, weight)
        kernels.forward = real
        out[fault] = {
            "equal_to_torch_path": all(torch.equal(a, b) for a, b in zip(got, (*reference, reference[0]))),
            "counts": dict(backend.counts),
            "why": dispatch.disabled_because(),
            "warnings": len(warned),
        }
        warned.clear()
    dispatch._state.update(why=None, checked=set())
    return out


@pytest.fixture(scope="module")
def interpreted():
    """This file run as a script under Triton's interpreter: {case: measurement}."""
    env = dict(os.environ, TRITON_INTERPRET="1", PACT_TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("dtype", DTYPES)
def test_each_kernel_equals_the_reference_product_within_one_rounding(interpreted, dtype):
    cases = {case: excess for case, excess in interpreted["numerics"].items() if case.split()[1] == dtype}
    products = {case.split()[0] for case in cases}
    assert products == {"forward", "input_grad", "weights"} and len(cases) == len(SHAPES) * 7
    off = {case: excess for case, excess in cases.items() if not case.startswith("weights") and excess > 1}
    assert not off, f"kernel results more than one {dtype} rounding from the reference: {off}"
    assert all(v is True for case, v in cases.items() if case.startswith("weights")), cases


def test_the_torch_backend_dispatches_to_the_kernels_as_for_cuda_tensors(interpreted):
    found = interpreted["dispatch"]
    assert found["same_as_kernels"]  # bit for bit: the backend ran the kernels, not its tiled CPU path
    assert found["counts"] == {"forward": 1, "input_grad": 1, "triton_forward": 1, "triton_input_grad": 1}
    assert found["unsupported"] == {"forward": 3, "input_grad": 1, "triton_forward": 1, "triton_input_grad": 1}
    assert found["without_flag"] == {"forward": 4, "input_grad": 2, "triton_forward": 1, "triton_input_grad": 1}


def test_frozen_linear_trains_through_the_kernels_as_on_the_cpu_path(interpreted):
    found = interpreted["autograd"]
    # forward, its recomputation under activation checkpointing, and the input gradient all ran in the kernels
    assert found["counts"] == {"forward": 2, "input_grad": 1, "triton_forward": 2, "triton_input_grad": 1}
    assert found["cpu_counts"] == {"forward": 4, "input_grad": 2, "triton_forward": 2, "triton_input_grad": 1}
    # the output and the input gradient equal the CPU path's within bf16 rounding (relative to their largest value)
    assert found["y_vs_cpu"] < 2**-7 and found["dx_vs_cpu"] < 2**-7
    assert found["product_excess"] <= 1


def test_a_failing_or_wrong_kernel_falls_back_to_the_torch_path_for_the_process_and_says_so_once(interpreted):
    found = interpreted["fallback"]
    assert found["self_check"] == {str(dtype): None for dtype in DTYPES.values()}  # the kernels pass their check
    assert found["strided_row_excess"] <= 1  # one row, its elements not adjacent: copied before the kernel reads it
    for fault, why in (("launch", "PTX compile failed"), ("mismatch", "forward kernel disagrees")):
        case = found[fault]
        assert case["equal_to_torch_path"], fault  # exactly what PACT_DISABLE_TRITON=1 computes
        assert case["counts"] == {"forward": 2, "input_grad": 1}, fault  # nothing counted as run in the kernels
        assert why in case["why"] and case["warnings"] == 1, case


def test_the_core_imports_and_computes_without_importing_triton():
    code = (
        "import sys, torch; from optimum_pact.backends import get_backend; from optimum_pact.nvfp4 import quantize;"
        "w = quantize(torch.randn(32, 64)); b = get_backend('auto');"
        "b.forward(torch.randn(4, 64), w); b.input_grad(torch.randn(4, 32), w);"
        "print(b.reason); assert 'triton' not in sys.modules, 'triton was imported'"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "PACT_TRITON_INTERPRET")}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Triton" not in proc.stdout  # no CUDA here: the reason is not the CUDA one


if __name__ == "__main__":  # the child process of `interpreted`
    print(
        json.dumps(
            {"numerics": _numerics(), "dispatch": _dispatch(), "autograd": _autograd(), "fallback": _fallback()}
        )
    )
