"""`get_backend` builds ONE backend instance per call, "auto" included, and says why that backend runs."""

import functools

import pytest
import torch

from optimum_pact.backends import Backend, BackendUnavailableError, get_backend, triton_dispatch
from optimum_pact.backends import qnn as qnn_module
from optimum_pact.backends.torch_backend import TorchBackend
from optimum_pact.nvfp4 import quantize

needs_qnn = pytest.mark.skipif(not qnn_module.is_qnn_available(), reason="needs onnxruntime-qnn (optimum-pact[qnn])")
EMULATOR = "the QNN HTP on x86_64 is an emulator, slower than the CPU"


@pytest.fixture(autouse=True)
def private_graph_cache(tmp_path, monkeypatch):
    # compiled graphs go to a temporary cache, not ~/.cache/optimum_pact/qnn
    monkeypatch.setenv("PACT_CACHE", str(tmp_path / "pact_cache"))


@pytest.fixture
def built_qnn(monkeypatch):
    """Every QnnBackend built from here on, in order."""
    built = []
    init = qnn_module.QnnBackend.__init__

    @functools.wraps(init)  # keeps the signature get_backend reads the options from
    def counting_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        built.append(self)

    monkeypatch.setattr(qnn_module.QnnBackend, "__init__", counting_init)
    return built


@needs_qnn
def test_auto_on_x86_64_is_torch_because_the_htp_is_an_emulator(monkeypatch, caplog, built_qnn):
    monkeypatch.setattr("platform.machine", lambda: "x86_64")
    with caplog.at_level("INFO", logger="optimum_pact.backends"):
        backend = get_backend("auto")
    assert type(backend) is TorchBackend and isinstance(backend, Backend)
    assert (backend.name, backend.requested, backend.reason) == ("torch", "auto", EMULATOR)
    assert "backend='auto' chose 'torch'" in caplog.text and EMULATOR in caplog.text
    assert built_qnn == []  # the emulator is not even started


def test_auto_without_onnxruntime_qnn_is_torch_and_says_so(monkeypatch, built_qnn):
    monkeypatch.setattr(qnn_module, "is_qnn_available", lambda: False)
    monkeypatch.setattr("platform.machine", lambda: "aarch64")
    backend = get_backend("auto")
    assert (backend.name, backend.requested, backend.reason) == ("torch", "auto", "onnxruntime-qnn is not installed")
    assert built_qnn == []


@pytest.mark.parametrize("triton", [True, False])
def test_auto_on_a_cuda_machine_is_torch_and_says_whether_the_triton_kernels_run(monkeypatch, built_qnn, triton):
    monkeypatch.setattr(qnn_module, "is_qnn_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(triton_dispatch, "triton_available", lambda: triton)
    backend = get_backend("auto", tile_size=64)
    assert type(backend) is TorchBackend and backend.tile_size == 64 and built_qnn == []
    if triton:
        assert backend.reason == "CUDA: torch backend with the Triton NVFP4 kernels"
    else:
        assert backend.reason.startswith("CUDA without triton") and "pip install 'optimum-pact[gpu]'" in backend.reason


def test_cpu_tensors_go_to_the_triton_kernels_only_under_the_interpreter_asked_twice(monkeypatch):
    weight = quantize(torch.randn(16, 32))
    x = torch.randn(2, 32)
    monkeypatch.setattr(triton_dispatch, "triton_available", lambda: True)
    for interpret, pact_interpret, expected in [
        ("1", "1", True),
        ("1", "", False),
        ("", "1", False),
        ("0", "1", False),
    ]:
        monkeypatch.setenv("TRITON_INTERPRET", interpret)
        monkeypatch.setenv("PACT_TRITON_INTERPRET", pact_interpret)
        assert triton_dispatch.runs_on_triton(x, weight) is expected
    assert not triton_dispatch.runs_on_triton(x.double(), weight)  # a dtype the kernels do not take
    assert not triton_dispatch.runs_on_triton(x, weight.dequantize(torch.float16))  # a 16-bit weight
    monkeypatch.setattr(triton_dispatch, "triton_available", lambda: False)
    assert not triton_dispatch.runs_on_triton(x, weight)


def test_a_triton_that_does_not_load_sends_the_products_to_torch_with_one_warning(monkeypatch, caplog):
    from optimum_pact.nvfp4 import quantize

    def broken(name, package=None):
        raise RuntimeError("0 active drivers")

    monkeypatch.setattr(triton_dispatch.importlib, "import_module", broken)
    monkeypatch.setattr(triton_dispatch, "_state", {"why": None, "checked": set()})
    triton_dispatch.kernels.cache_clear()  # past the cache of the loaded module
    weight, x = quantize(torch.randn(32, 64)), torch.randn(4, 64)
    with caplog.at_level("WARNING", logger=triton_dispatch.__name__):
        assert triton_dispatch.triton_product("forward", x, weight) is None  # the caller runs the torch path
        assert triton_dispatch.triton_product("input_grad", torch.randn(4, 32), weight) is None
    assert "RuntimeError" in triton_dispatch.disabled_because() and "0 active drivers" in caplog.text
    assert len(caplog.records) == 1 and "PACT_DISABLE_TRITON=1" in caplog.text
    assert not triton_dispatch.runs_on_triton(x, weight)  # off for the rest of the process
    triton_dispatch.kernels.cache_clear()


@needs_qnn
def test_auto_keeps_the_options_of_its_choice_and_drops_the_others(monkeypatch):
    monkeypatch.setattr("platform.machine", lambda: "x86_64")
    backend = get_backend("auto", soc_model="69", tile_size=64)
    assert type(backend) is TorchBackend and backend.tile_size == 64
    assert not hasattr(backend, "soc_model")


def test_an_explicit_name_is_requested_and_its_unknown_options_are_errors():
    backend = get_backend("torch", tile_size=32)
    assert (backend.name, backend.requested, backend.reason, backend.tile_size) == ("torch", "torch", "requested", 32)
    assert get_backend("torch") is not get_backend("torch")  # one instance per call: nothing cached
    with pytest.raises(ValueError, match=r"backend='torch' has no option soc_model='69'; its options are tile_size"):
        get_backend("torch", soc_model="69")
    # tile_size belongs to the torch backend now; the message says so (no qnn runtime needed to see it)
    with pytest.raises(ValueError, match=r"no option tile_size=64; its options are soc_model, .*backend='torch'"):
        get_backend("qnn", tile_size=64)
    with pytest.raises(ValueError, match="tile_size=24 is invalid"):
        get_backend("torch", tile_size=24)
    with pytest.raises(ValueError, match="Unknown backend 'npu'"):
        get_backend("npu")


@needs_qnn
def test_auto_on_an_npu_machine_returns_the_qnn_backend_it_built(monkeypatch, built_qnn):
    starts = []
    start = qnn_module._start_htp
    monkeypatch.setattr(qnn_module, "_start_htp", lambda soc_model: (starts.append(soc_model), start(soc_model)))
    monkeypatch.setattr("platform.machine", lambda: "x86_64")
    assert get_backend("auto").name == "torch"  # resolved at each call, not once per process
    monkeypatch.setattr("platform.machine", lambda: "aarch64")
    backend = get_backend("auto", soc_model="69", tile_size=64, min_tokens=32)
    assert isinstance(backend, qnn_module.QnnBackend) and isinstance(backend, Backend)
    assert (backend.requested, backend.reason) == ("auto", "the QNN HTP backend started")
    assert backend.soc_model == "69" and backend.min_tokens == 32  # its options reach it; tile_size is dropped
    assert built_qnn == [backend] and starts == ["69"]  # the instance returned is the one built: no probe instance
    assert backend.forward(torch.randn(3, 32), backend.prepare(quantize(torch.randn(16, 32)))).shape == (3, 16)


@needs_qnn
def test_auto_falls_back_to_torch_when_the_htp_does_not_start(monkeypatch, caplog, built_qnn):
    def no_device():
        raise BackendUnavailableError("no HTP device")

    monkeypatch.setattr(qnn_module, "_qnn_devices", no_device)
    monkeypatch.setattr("platform.machine", lambda: "aarch64")
    with caplog.at_level("WARNING", logger="optimum_pact.backends"):
        backend = get_backend("auto", tile_size=32)
    assert type(backend) is TorchBackend and backend.tile_size == 32
    assert backend.reason == "the QNN HTP backend did not start (no HTP device)" and backend.requested == "auto"
    assert "falling back to 'torch'" in caplog.text
    assert built_qnn == []


def test_torch_backend_runs_on_the_cpu_and_keeps_bf16():
    backend = get_backend("torch")
    assert backend.runs_beside_cpu is False
    assert backend.dense_weight_dtype(torch.bfloat16) == torch.bfloat16
    assert backend.dense_weight_dtype(torch.float32) == backend.dense_weight_dtype(torch.float16) == torch.float16


@pytest.mark.parametrize("native", [False, True])
def test_torch_backend_multiplies_bf16_in_fp32_where_bf16_is_emulated(monkeypatch, native):
    """Without native bf16 (AVX2 CPUs) a bf16 product of many rows is the fp32 product of the same bf16 values,
    rounded once: the same effective weights, forward and input gradient; with it, torch's bf16 product."""
    from optimum_pact.backends import torch_backend

    monkeypatch.setattr(torch_backend, "native_bf16", lambda: native)
    torch.manual_seed(0)
    backend, q = TorchBackend(), quantize(torch.randn(256, 576))  # big enough that the two products differ here
    w = q.dequantize(torch.bfloat16)
    x, dy = torch.randn(2, 64, 576, dtype=torch.bfloat16), torch.randn(2, 64, 256, dtype=torch.bfloat16)
    y, dx = backend.forward(x, q), backend.input_grad(dy, q)
    if native:
        expected_y, expected_dx = x @ w.T, dy @ w
    else:
        expected_y, expected_dx = (x.float() @ w.float().T).bfloat16(), (dy.float() @ w.float()).bfloat16()
    assert y.dtype == dx.dtype == torch.bfloat16
    torch.testing.assert_close(y, expected_y, atol=0, rtol=0)
    torch.testing.assert_close(dx, expected_dx, atol=0, rtol=0)
    # one bf16 rounding of a sum accumulated in fp32: within 2**-8 of the exact product, plus the accumulation's bound
    exact, terms = x.double() @ w.double().T, x.double().abs() @ w.double().abs().T
    assert ((y.double() - exact).abs() <= 2**-8 * exact.abs() + 576 * 2**-24 * terms).all()


@needs_qnn
def test_qnn_backend_runs_beside_the_cpu_and_stores_fp16():
    backend = get_backend("qnn", cache=False)
    assert (backend.name, backend.requested, backend.reason) == ("qnn", "qnn", "requested")
    assert backend.runs_beside_cpu is True
    for source in (torch.bfloat16, torch.float32, torch.float16):
        assert backend.dense_weight_dtype(source) == torch.float16


@needs_qnn
def test_one_instance_shares_its_sessions_and_two_instances_do_not():
    torch.manual_seed(0)
    first, second = get_backend("qnn", cache=False), get_backend("qnn", cache=False)
    weights = [quantize(torch.randn(48, 64)) for _ in range(3)]
    x = torch.randn(5, 64)
    for weight in weights:  # three layers of one shape on one instance: one compiled graph
        first.forward(x, first.prepare(weight))
    assert list(first.graph_placement()) == [("forward", 48, 64, 16, "nvfp4")]
    (shared,) = first._runtime.sessions.values()
    first.forward(x, first.prepare(weights[0]))
    assert list(first._runtime.sessions.values()) == [shared]  # still the same session object

    assert second.graph_placement() == {}  # nothing compiled by the first instance is visible here
    second.forward(x, second.prepare(weights[0]))
    (own,) = second._runtime.sessions.values()
    assert second._runtime is not first._runtime and own is not shared


@pytest.mark.parametrize("tile_size", [None, 32])
def test_products_reuse_one_scratch_buffer_per_thread_and_stay_exact(tile_size):
    """The dequantized weight goes into a buffer kept per thread: the next layer overwrites it, and each result is
    still exactly the dense product against its own weight (forward, then the input gradients in reverse order)."""
    import threading

    from optimum_pact.backends import torch_backend

    torch.manual_seed(0)
    backend = TorchBackend(tile_size=tile_size)
    first, second = quantize(torch.randn(96, 64)), quantize(torch.randn(64, 96))
    x = torch.randn(2, 5, 64)
    h = backend.forward(x, first)
    buffer = torch_backend._SCRATCH.buffers[torch.float32]
    y = backend.forward(h, second)
    dy = torch.randn_like(y)
    dh = backend.input_grad(dy, second)
    dx = backend.input_grad(dh, first)
    w1, w2 = first.dequantize(torch.float32), second.dequantize(torch.float32)
    exact = tile_size is None  # one tile is the dense product bit for bit; tiles sum in their own order
    tol = dict(atol=0, rtol=0) if exact else dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(h, x @ w1.T, **tol)
    torch.testing.assert_close(y, h @ w2.T, **tol)
    torch.testing.assert_close(dh, dy @ w2, **tol)
    torch.testing.assert_close(dx, dh @ w1, **tol)
    assert torch_backend._SCRATCH.buffers[torch.float32].data_ptr() == buffer.data_ptr()  # reused, not reallocated
    if exact:  # the last product's weight is what the buffer holds
        assert torch.equal(buffer[: w1.numel()], w1.reshape(-1))
    other = []
    thread = threading.Thread(target=lambda: other.append((backend.forward(x, first), torch_backend._SCRATCH.buffers)))
    thread.start()
    thread.join()
    torch.testing.assert_close(other[0][0], h, atol=0, rtol=0)
    assert other[0][1][torch.float32].data_ptr() != buffer.data_ptr()  # each thread has its own
