"""The overlapped LoRA layer: the backend's frozen product in a worker thread beside the CPU's adapter path."""

import threading

import pytest
import torch
from conftest import tiny_model, train_lm
from peft import get_peft_model

from optimum_pact.backends import qnn as qnn_module
from optimum_pact.backends.torch_backend import TorchBackend
from optimum_pact.dataflow import FrozenLinear
from peft_ext import PactConfig
from peft_ext.layer import PactLoraLinear


def _grads(model, ids):
    model.zero_grad()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("alpha", [8, 6])  # scaling 2 (a power of two: multiplied on the rank-sized side) and 1.5
def test_one_node_layer_serial_and_overlapped_equals_peft_path(arch, dtype, alpha, monkeypatch):
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    runs = {}
    for path in ("peft", False, True):
        overlap = path if isinstance(path, bool) else False
        config = PactConfig(
            r=4, lora_alpha=alpha, target_modules="all-linear", init_lora_weights="gaussian", overlap=overlap
        )
        model = get_peft_model(tiny_model(arch).to(dtype), config)
        assert all(m.pact_overlap is overlap for m in model.modules() if isinstance(m, PactLoraLinear))
        with monkeypatch.context() as patch:
            if path == "peft":  # peft's own forward: lora.Linear's casts, products, scaling and sum as autograd nodes
                patch.setattr(PactLoraLinear, "_plain_adapter", lambda self, args, kwargs: None)
            runs[path] = _grads(model, ids)
    loss_a, grads_a = runs["peft"]
    for path in (False, True):
        loss_b, grads_b = runs[path]
        torch.testing.assert_close(loss_b, loss_a, atol=0, rtol=0)
        assert grads_a.keys() == grads_b.keys() and len(grads_a) == 28
        for name in grads_a:  # same products, same dtypes: equal up to the order BLAS accumulates the adapter grads
            tol = {"atol": 1e-6, "rtol": 1e-5 if dtype == torch.float32 else 0}
            torch.testing.assert_close(grads_b[name], grads_a[name], **tol)


def test_layers_fed_the_same_input_share_its_cast_until_it_changes():
    from optimum_pact.dataflow import overlap

    model = get_peft_model(tiny_model().to(torch.bfloat16), PactConfig(r=4, target_modules="all-linear"))
    attn = model.base_model.model.model.layers[0].self_attn
    x = torch.randn(1, 5, attn.q_proj.in_features, dtype=torch.bfloat16, requires_grad=True)
    q, k = attn.q_proj(x), attn.k_proj(x)
    saved_q, saved_k = q.grad_fn.saved_tensors[0], k.grad_fn.saved_tensors[0]
    assert saved_q.dtype == torch.float32 and saved_q.data_ptr() == saved_k.data_ptr()  # cast once, saved once
    torch.testing.assert_close(saved_q, x.detach().float(), atol=0, rtol=0)
    with torch.no_grad():
        x.mul_(2)  # written in place (exactly): its version moves, so the next layer casts it again
    v = attn.v_proj(x)
    saved_v = v.grad_fn.saved_tensors[0]
    assert saved_v.data_ptr() != saved_q.data_ptr()
    torch.testing.assert_close(saved_v, x.detach().float(), atol=0, rtol=0)
    torch.testing.assert_close(saved_q * 2, saved_v, atol=0, rtol=0)  # q's copy kept what q read
    del q, k, v, saved_q, saved_k, saved_v
    assert overlap._last_cast[3]() is None  # the cache kept nothing alive once the graph was gone


class RecordingBackend(TorchBackend):
    """The torch backend, noting which thread ran each product."""

    def __init__(self):
        super().__init__()
        self.threads = set()

    def forward(self, x, handle):
        self.threads.add(threading.current_thread().name)
        return super().forward(x, handle)

    def input_grad(self, dy, handle):
        self.threads.add(threading.current_thread().name)
        return super().input_grad(dy, handle)


def test_frozen_products_run_in_the_backend_thread_and_training_learns():
    model = get_peft_model(tiny_model("llama"), PactConfig(r=4, target_modules="all-linear", overlap=True))
    backend = RecordingBackend()
    for m in model.modules():
        if isinstance(m, FrozenLinear):
            m.backend, m._handle = backend, None
    losses = train_lm(model, steps=20)
    assert losses[-1] < losses[0] - 0.5
    assert backend.threads == {"pact-backend_0"} and backend.counts["forward"] == 14 * 20
    # block 0's q/k/v read the embeddings, which need no gradient: their input gradient is rightly never computed
    assert backend.counts["input_grad"] == 11 * 20


def test_overlap_defaults_follow_the_backend_and_dropout_takes_peft_path():
    model = get_peft_model(tiny_model("llama"), PactConfig(r=4, target_modules=["q_proj"]))
    layer = next(m for m in model.modules() if isinstance(m, PactLoraLinear))
    assert layer.pact_overlap is False  # torch backend: the CPU would compete with itself
    model = get_peft_model(
        tiny_model("llama"), PactConfig(r=4, target_modules=["q_proj"], lora_dropout=0.1, overlap=True)
    )
    layer = next(m for m in model.modules() if isinstance(m, PactLoraLinear))
    assert layer._plain_adapter((), {}) is None  # dropout while training: peft's own path
    layer.eval()
    assert layer._plain_adapter((), {}) == "default"  # in eval mode dropout does nothing
    with pytest.raises(ValueError, match="overlap='yes'"):
        PactConfig(overlap="yes")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decoding_runs_product_and_adapter_in_one_fused_call_equal_to_peft(arch, dtype, monkeypatch):
    from peft.tuners.lora import Linear as LoraLinear

    from optimum_pact.nvfp4.kernels import NativeLinear

    calls = []
    real = NativeLinear.run
    spy = lambda self, x: calls.append(self.lora_versions) or real(self, x)  # noqa: E731
    monkeypatch.setattr(NativeLinear, "run", spy)
    config = PactConfig(r=4, target_modules="all-linear", init_lora_weights=False)
    model = get_peft_model(tiny_model(arch), config)  # qwen2: q, k, v with bias
    model = model.to(dtype).eval()
    layers = [m for m in model.modules() if isinstance(m, PactLoraLinear)]
    x = torch.randn(1, 2, 64, dtype=dtype)
    for layer in layers[:4]:  # q, k, v (with bias on qwen2), o
        calls.clear()
        with torch.no_grad():
            fused = layer(x)
            assert len(calls) == 1 and calls[0] is not None  # one native call, the adapter's term inside it
            reference = LoraLinear.forward(layer, x)  # peft's own: the frozen product, then the adapter
        tolerance = 1e-5 if dtype == torch.float32 else 2e-2  # peft rounds the product to bf16 before the adapter
        torch.testing.assert_close(fused, reference, rtol=tolerance, atol=tolerance)
    layer = layers[0]
    with torch.no_grad():  # the bound product follows the adapter: changed in place (an optimizer step), rescaled
        bound = layer._pact_fused
        layer.lora_B["default"].weight.mul_(-2)
        layer.set_scale("default", 0.5)
        torch.testing.assert_close(layer(x), LoraLinear.forward(layer, x), rtol=tolerance, atol=tolerance)
        assert layer._pact_fused is not bound
        bound = layer._pact_fused
        layer(x)
        assert layer._pact_fused is bound  # and is reused while nothing changed
    calls.clear()
    fused = layer(x)  # training (autograd on): peft's path, the product dequantized as in training
    assert all(lora is None for lora in calls)


@pytest.mark.skipif(not qnn_module.is_qnn_available(), reason="needs onnxruntime-qnn (optimum-pact[qnn])")
def test_qnn_overlaps_by_default_and_matches_the_sequential_path(tmp_path, monkeypatch):
    monkeypatch.setenv("PACT_CACHE", str(tmp_path))
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    runs = {}
    for overlap in (None, False):
        config = PactConfig(
            r=4, target_modules="all-linear", backend="qnn", init_lora_weights="gaussian", overlap=overlap
        )
        model = get_peft_model(tiny_model("llama"), config)
        layers = [m for m in model.modules() if isinstance(m, PactLoraLinear)]
        assert all(m.pact_overlap is (overlap is None) for m in layers)
        runs[overlap] = _grads(model, ids)
    torch.testing.assert_close(runs[None][0], runs[False][0], atol=0, rtol=0)
    for name, grad in runs[False][1].items():
        torch.testing.assert_close(runs[None][1][name], grad, atol=1e-6, rtol=1e-5)
