"""The fast NVFP4 dequantizers (native C kernel and pure-torch path) against the reference, bit for bit."""

from __future__ import annotations

import logging
import platform
import shutil
from pathlib import Path

import pytest
import torch

from optimum_pact.nvfp4 import dequantize, dequantize_reference, kernels, quantize

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
HAS_CC = shutil.which("cc") is not None
needs_native = pytest.mark.skipif(not HAS_CC, reason="no C compiler")
_INT = {4: torch.int32, 2: torch.int16}


def assert_bitwise(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.dtype == ref.dtype and out.shape == ref.shape and out.is_contiguous()
    bits, ref_bits = out.view(_INT[out.element_size()]), ref.view(_INT[ref.element_size()])
    mismatch = (bits != ref_bits).nonzero()
    assert mismatch.numel() == 0, f"{mismatch.shape[0]} elements differ, first at {mismatch[0].tolist()}"


def native(q, s, s2, dtype):
    return kernels.dequantize_native(q, s, s2, dtype)


def native_scalar(q, s, s2, dtype):
    return kernels.dequantize_native(q, s, s2, dtype, scalar=True)


PATHS = [
    pytest.param(native, id="native", marks=needs_native),
    pytest.param(native_scalar, id="native-portable", marks=needs_native),
    pytest.param(kernels.dequantize_torch, id="torch"),
]


def random_raw(n: int, k: int, scale_2: float, seed: int = 0):
    """Arbitrary valid bytes: every code, every e4m3 scale but NaN (subnormal, zero, negative, max included)."""
    g = torch.Generator().manual_seed(seed)
    qdata = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
    scale = torch.randint(0, 256, (n, k // 16), dtype=torch.uint8, generator=g)
    scale[(scale & 0x7F) == 0x7F] -= 1  # 0x7F / 0xFF are NaN in e4m3fn, never produced by quantize
    special = torch.tensor([0x00, 0x80, 0x01, 0x02, 0x07, 0x08, 0x7E, 0xFE], dtype=torch.uint8)
    flat = scale.view(-1)
    flat[: min(flat.numel(), special.numel())] = special[: flat.numel()]
    return qdata, scale.view(torch.float8_e4m3fn), torch.tensor(scale_2, dtype=torch.float32)


def special_weight() -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    w = torch.randn(48, 96, generator=g)
    w[0] = 0.0  # all-zero row: zero scales
    w[1, 5] = 1e4  # one huge outlier: sets scale_2, other blocks get tiny (clamped) scales
    w[2] *= 1e-6
    w[3, :16] = torch.tensor([1e-8, -1e-8] * 8)
    w[4, 16:32] = 6.0 * 448.0  # a block at the max scale
    return w


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 16), (5, 32), (17, 48), (64, 576), (130, 1536)])
def test_quantized_weights_bitwise(path, dtype, shape):
    w = quantize(torch.randn(*shape, generator=torch.Generator().manual_seed(shape[0])))
    assert_bitwise(path(w.qdata, w.scale, w.scale_2, dtype), dequantize_reference(w.qdata, w.scale, w.scale_2, dtype))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "scale_2", [1.0, 3.7e-4, 1e-37, 2.0**-140, 5e35], ids=["one", "typical", "tiny", "denormal", "huge"]
)
def test_raw_bytes_bitwise(path, dtype, scale_2):
    """Every code and scale byte; tiny scale_2 gives fp32/bf16/fp16 denormals, huge overflows to inf."""
    q, s, s2 = random_raw(33, 160, scale_2)
    assert_bitwise(path(q, s, s2, dtype), dequantize_reference(q, s, s2, dtype))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_special_blocks_bitwise(path, dtype):
    w = quantize(special_weight())
    assert_bitwise(path(w.qdata, w.scale, w.scale_2, dtype), dequantize_reference(w.qdata, w.scale, w.scale_2, dtype))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_row_and_column_slices(path, dtype):
    """The tiles the torch backend dequantizes: row slices and column slices (strided, last dim contiguous)."""
    w = quantize(torch.randn(96, 320, generator=torch.Generator().manual_seed(7)))
    for rows in (slice(0, 32), slice(17, 96), slice(95, 96)):
        q, s = w.qdata[rows], w.scale[rows]
        assert_bitwise(path(q, s, w.scale_2, dtype), dequantize_reference(q, s, w.scale_2, dtype))
    for k0, k1 in ((0, 16), (16, 64), (48, 320), (304, 320), (0, 320)):
        q, s = w.qdata[:, k0 // 2 : k1 // 2], w.scale[:, k0 // 16 : k1 // 16]
        assert q.stride(-1) == 1 and s.stride(-1) == 1
        assert_bitwise(path(q, s, w.scale_2, dtype), dequantize_reference(q, s, w.scale_2, dtype))
    q, s = w.qdata[5:60, 8:40], w.scale[5:60, 1:5]  # both at once
    assert_bitwise(path(q, s, w.scale_2, dtype), dequantize_reference(q, s, w.scale_2, dtype))


@pytest.mark.parametrize("path", PATHS)
def test_empty_and_threads(path):
    w = quantize(torch.randn(40, 64))
    assert path(w.qdata[:0], w.scale[:0], w.scale_2, torch.bfloat16).shape == (0, 64)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            out = path(w.qdata, w.scale, w.scale_2, torch.bfloat16)
            assert_bitwise(out, dequantize_reference(w.qdata, w.scale, w.scale_2, torch.bfloat16))
    finally:
        torch.set_num_threads(threads)


@needs_native
def test_native_is_used_here(monkeypatch):
    """CI runs on x86_64 Linux with gcc: the native kernel must build, with the widest SIMD path the CPU has."""
    monkeypatch.delenv("PACT_DISABLE_NATIVE", raising=False)
    assert kernels.native_available()
    flags = Path("/proc/cpuinfo").read_text() if platform.machine() == "x86_64" else ""
    if "avx512bw" in flags:
        assert kernels._native().pact_nvfp4_has_avx512() == 1
    elif " avx2" in flags:  # a CPU without AVX-512 gets the AVX2 path, not the portable one
        assert kernels._native().pact_nvfp4_has_avx2() == 1

    def forbidden(*args, **kwargs):
        raise AssertionError("the torch path ran although the native kernel is available")

    monkeypatch.setattr(kernels, "dequantize_torch", forbidden)
    w = quantize(torch.randn(32, 64))
    ref = dequantize_reference(w.qdata, w.scale, w.scale_2, torch.bfloat16)
    assert_bitwise(dequantize(w.qdata, w.scale, w.scale_2, torch.bfloat16), ref)


def test_disable_native_env(monkeypatch):
    monkeypatch.setenv("PACT_DISABLE_NATIVE", "1")
    assert not kernels.native_available()
    monkeypatch.setattr(kernels, "dequantize_native", lambda *a, **k: pytest.fail("native path ran"))
    w = quantize(special_weight())
    for dtype in DTYPES:
        ref = dequantize_reference(w.qdata, w.scale, w.scale_2, dtype)
        assert_bitwise(dequantize(w.qdata, w.scale, w.scale_2, dtype), ref)


@needs_native
def test_build_cache_is_keyed_by_source(monkeypatch, tmp_path):
    monkeypatch.setenv("PACT_CACHE", str(tmp_path))
    kernels._build()
    first = sorted((tmp_path / "kernels").iterdir())
    assert [p.suffix for p in first] == [".so"]  # no temporary file left behind
    mtime = first[0].stat().st_mtime_ns
    kernels._build()  # reused, not rebuilt
    assert sorted((tmp_path / "kernels").iterdir()) == first and first[0].stat().st_mtime_ns == mtime
    changed = tmp_path / "dequant.c"
    changed.write_text(kernels._SOURCE.read_text() + "\n/* changed */\n")
    monkeypatch.setattr(kernels, "_SOURCE", changed)
    lib = kernels._build()
    assert len(list((tmp_path / "kernels").glob("*.so"))) == 2
    q, s, s2 = random_raw(8, 64, 0.01)
    out = torch.empty(8, 64, dtype=torch.bfloat16)
    assert lib.pact_nvfp4_dequantize(q.data_ptr(), 32, s.data_ptr(), 4, 0.01, 8, 64, out.data_ptr(), 1, 0, 1) == 0
    assert_bitwise(out, dequantize_reference(q, s, s2, torch.bfloat16))


@pytest.mark.parametrize("failure", ["no-compiler", "bad-source"])
def test_build_failure_warns_once_and_falls_back(monkeypatch, tmp_path, caplog, failure):
    monkeypatch.setenv("PACT_CACHE", str(tmp_path))
    monkeypatch.delenv("PACT_DISABLE_NATIVE", raising=False)
    monkeypatch.setattr(kernels, "_lib", None)
    monkeypatch.setattr(kernels, "_failed", False)
    if failure == "no-compiler":
        monkeypatch.setenv("CC", "no-such-compiler-pact")
    else:
        if not HAS_CC:
            pytest.skip("no C compiler")
        broken = tmp_path / "dequant.c"
        broken.write_text("this is not C;\n")
        monkeypatch.setattr(kernels, "_SOURCE", broken)
    w = quantize(special_weight())
    with caplog.at_level(logging.WARNING, logger=kernels.__name__):
        for dtype in DTYPES:
            ref = dequantize_reference(w.qdata, w.scale, w.scale_2, dtype)
            assert_bitwise(dequantize(w.qdata, w.scale, w.scale_2, dtype), ref)
        assert not kernels.native_available()
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert ("no-such-compiler-pact" if failure == "no-compiler" else "failed") in warnings[0].getMessage()
    assert not list(tmp_path.rglob("*.tmp"))  # a failed build leaves no temporary file


def test_other_dtypes_use_the_reference():
    w = quantize(special_weight())
    out = dequantize(w.qdata, w.scale, w.scale_2, torch.float64)
    assert out.dtype == torch.float64 and torch.equal(
        out, dequantize_reference(w.qdata, w.scale, w.scale_2, torch.float64)
    )
    with pytest.raises(TypeError):
        kernels.dequantize_native(w.qdata.float(), w.scale, w.scale_2, torch.float32)


@needs_native
@pytest.mark.parametrize("tile_size", [None, 32])
def test_frozen_linear_native_equals_torch_path(monkeypatch, tile_size):
    """Forward and input gradient through FrozenLinear (row and column tiles): both dequantizers, same bits."""
    from optimum_pact.backends import get_backend
    from optimum_pact.dataflow.linear import FrozenLinear

    torch.manual_seed(0)
    layer = FrozenLinear.from_linear(torch.nn.Linear(96, 80), backend=get_backend("torch", tile_size=tile_size))
    x = torch.randn(3, 7, 96, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(3, 7, 80, dtype=torch.bfloat16)
    results = []
    for disable in ("0", "1"):
        monkeypatch.setenv("PACT_DISABLE_NATIVE", disable)
        x.grad = None
        y = layer(x)
        y.backward(g)
        results.append((y.detach(), x.grad))
    assert_bitwise(results[0][0], results[1][0])
    assert_bitwise(results[0][1], results[1][1])


@needs_native
def test_threads_concurrent_callers_and_fork():
    """Several calling threads at once, and a forked child that sets one thread as DataLoader workers do."""
    import os
    import time
    from concurrent.futures import ThreadPoolExecutor

    weights = [quantize(torch.randn(256 + 16 * i, 512, generator=torch.Generator().manual_seed(i))) for i in range(4)]
    refs = [dequantize_reference(w.qdata, w.scale, w.scale_2, torch.bfloat16).view(torch.int16) for w in weights]
    refs = [r.numpy().tobytes() for r in refs]

    def check(i):  # compares bytes: no torch op that could start OpenMP threads in a forked child
        w = weights[i % 4]
        out = kernels.dequantize_native(w.qdata, w.scale, w.scale_2, torch.bfloat16)
        return out.view(torch.int16).numpy().tobytes() == refs[i % 4]

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        with ThreadPoolExecutor(4) as pool:
            assert all(pool.map(check, range(64)))
        pid = os.fork()
        if pid == 0:  # OpenMP (torch's and ours) cannot use threads in a forked child: one thread, as DataLoader does
            torch.set_num_threads(1)
            os._exit(0 if all(check(i) for i in range(8)) else 1)
        deadline, status = time.monotonic() + 60, None
        while status is None and time.monotonic() < deadline:
            done, code = os.waitpid(pid, os.WNOHANG)
            if done:
                status = code
            else:
                time.sleep(0.05)
        if status is None:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
        assert status == 0, "the forked child failed or hung"
        assert all(check(i) for i in range(8))
    finally:
        torch.set_num_threads(threads)


# ---- the fused product for few rows (decoding) ----


@needs_native
@pytest.mark.parametrize("scalar", [False, True])
# k: whole groups of 4 blocks (576, 4864) and groups plus 1-3 blocks (96, 112, 48), the AVX2 path's two loops
@pytest.mark.parametrize(("rows", "n", "k"), [(1, 80, 96), (3, 1536, 576), (8, 64, 4864), (2, 40, 112), (1, 8, 48)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rank", [0, 8, 12])
def test_fused_linear_equals_the_reference_up_to_fp32_summation_order(scalar, rows, n, k, dtype, rank):
    from optimum_pact.nvfp4.kernels import linear_native

    torch.manual_seed(rows + n)
    q = quantize(torch.randn(n, k) * torch.rand(n, 1) * 3)
    x = torch.randn(rows, k).to(dtype)
    lora = _lora(rank, n, k)
    got = linear_native(q.qdata, q.scale, q.scale_2, x, lora=lora, scalar=scalar)
    _assert_fused(got, x, q.dequantize(torch.float64), lora)


def _lora(rank: int, n: int, k: int):
    return (torch.randn(rank, k) / k**0.5, torch.randn(n, rank), 0.5) if rank else None


def _assert_fused(got, x, w, lora) -> None:
    """`got` is `x @ w.T` (+ the adapter's term) summed in fp32 and rounded once into x's dtype."""
    assert got.dtype == x.dtype and got.shape == (x.shape[0], w.shape[0])
    expected = x.double() @ w.double().T  # exact sums
    magnitude = x.abs().double() @ w.abs().double().T
    rank = 0
    if lora is not None:  # the adapter's term, added in the same pass before the one rounding
        a, b, scaling = lora
        rank = a.shape[0]
        expected = expected + (scaling * (x.double() @ a.double().T)) @ b.double().T
        magnitude = magnitude + (scaling * (x.abs().double() @ a.abs().double().T)) @ b.abs().double().T
    bound = 4 * (x.shape[1] + rank) * torch.finfo(torch.float32).eps * magnitude  # the fp32 rounding of the sums
    bound = bound + torch.finfo(x.dtype).eps / 2 * (expected.abs() + bound)  # and the one rounding into x's dtype
    assert ((got.double() - expected).abs() <= bound).all()


@needs_native
@pytest.mark.parametrize("scalar", [False, True])
@pytest.mark.parametrize(("rows", "n", "k"), [(1, 80, 96), (3, 1536, 576), (8, 64, 4864), (2, 40, 112), (1, 8, 48)])
@pytest.mark.parametrize("wdtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rank", [0, 8])
def test_fused_linear_on_a_dense_weight_equals_the_reference_up_to_fp32_summation_order(
    scalar, rows, n, k, wdtype, dtype, rank
):
    """A layer kept 16-bit, or an fp32 output head, decodes through the same kernel: its row widened to fp32 (16-bit),
    fp32 sums, the adapter's term, one rounding. A wrong widening (fp16 read as bf16, an fp32 row read as 16-bit
    halves) or a lost term is far outside the bound."""
    from optimum_pact.nvfp4.kernels import NativeLinear

    torch.manual_seed(rows + n)
    w = (torch.randn(n, k) * torch.rand(n, 1) * 3).to(wdtype)
    x = torch.randn(rows, k).to(dtype)
    lora = _lora(rank, n, k)
    _assert_fused(NativeLinear(w, lora=lora, scalar=scalar)(x), x, w, lora)
    with pytest.raises(ValueError, match="dense weight"):
        NativeLinear(w.double())


@pytest.fixture
def native_calls(monkeypatch) -> list:
    """The shapes of the x each native fused product is called with, from now on."""
    from optimum_pact.nvfp4.kernels import NativeLinear

    calls = []
    real = NativeLinear.run
    monkeypatch.setattr(NativeLinear, "run", lambda self, x: calls.append(x.shape) or real(self, x))
    return calls


@needs_native
def test_the_torch_backend_decodes_16bit_layers_with_their_adapter_natively_and_trains_them_as_before(native_calls):
    from optimum_pact.backends import get_backend

    calls = native_calls
    backend = get_backend("torch")
    w = torch.randn(64, 96).to(torch.bfloat16)
    a, b = torch.randn(4, 96), torch.randn(64, 4)
    x = torch.randn(1, 1, 96, dtype=torch.bfloat16)
    with torch.no_grad():
        plain, fused = backend.forward(x, w), backend.bind_lora(w, a, b, 2.0)(x)
    assert calls == [(1, 1, 96)]  # the adapter's: a 16-bit layer alone multiplies as in training
    assert torch.equal(plain, x @ w.T)
    lora = 2.0 * (x.float() @ a.T) @ b.T
    torch.testing.assert_close(fused, (x.float() @ w.float().T + lora).to(torch.bfloat16), atol=0, rtol=1e-2)
    assert backend.bind_lora(w.float(), a, b, 2.0) is None  # fp32 weights are not a 16-bit layer's
    assert len(calls) == 1


@needs_native
def test_the_torch_backend_fuses_only_inference_on_few_rows(native_calls):
    from optimum_pact.backends import get_backend

    calls = native_calls
    backend = get_backend("torch")
    q = quantize(torch.randn(64, 96))
    x = torch.randn(1, 2, 96, dtype=torch.bfloat16)
    with torch.no_grad():
        fused = backend.forward(x, q)
    assert calls == [(1, 2, 96)] and fused.shape == (1, 2, 64) and fused.dtype == torch.bfloat16
    reference = (x.float() @ q.dequantize(torch.float32).T).to(torch.bfloat16)
    torch.testing.assert_close(fused, reference, atol=0, rtol=1e-2)
    trained = backend.forward(x, q)  # grad enabled: training's path, the same as the input gradient's weights
    assert len(calls) == 1
    torch.testing.assert_close(trained, x @ q.dequantize(torch.bfloat16).T, atol=0, rtol=0)
    with torch.no_grad():
        backend.forward(torch.randn(9, 96), q)  # more rows than FUSED_MAX_ROWS: dequantize and multiply
    assert len(calls) == 1


@needs_native
def test_native_dequantize_writes_into_a_given_buffer_and_refuses_one_that_does_not_fit():
    q = quantize(torch.randn(32, 64))
    out = torch.full((32, 64), float("nan"), dtype=torch.bfloat16)
    got = kernels.dequantize_native(q.qdata, q.scale, q.scale_2, torch.bfloat16, out=out)
    assert got.data_ptr() == out.data_ptr()
    assert torch.equal(out, dequantize_reference(q.qdata, q.scale, q.scale_2, torch.bfloat16))
    bf16 = torch.bfloat16
    for bad in (torch.empty(32, 48, dtype=bf16), torch.empty(32, 64), torch.empty(64, 32, dtype=bf16).t()):
        with pytest.raises(ValueError, match=r"contiguous CPU torch.bfloat16 tensor of shape \(32, 64\)"):
            kernels.dequantize_native(q.qdata, q.scale, q.scale_2, torch.bfloat16, out=bad)
