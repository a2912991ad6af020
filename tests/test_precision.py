"""Precision: the per-row FP16 range guard, 16-bit layers, the gradient-sensitivity probe and the saved plan."""

import math

import pytest
import torch
from conftest import tiny_model
from peft import get_peft_model
from peft.tuners.lora import LoraLayer

from optimum_pact.backends import get_backend
from optimum_pact.backends import qnn as qnn_module
from optimum_pact.dataflow import FrozenLinear
from optimum_pact.nvfp4 import quantize
from optimum_pact.precision import plan_precision, probe_sensitivity, row_exponents, scale_rows, unscale_rows
from optimum_pact.precision.plan import LayerSensitivity
from optimum_pact.precision.range_guard import LIMIT
from peft_ext import PactConfig
from peft_ext.precision import probe_precision

needs_qnn = pytest.mark.skipif(not qnn_module.is_qnn_available(), reason="needs onnxruntime-qnn (optimum-pact[qnn])")


@pytest.fixture(autouse=True)
def private_graph_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PACT_CACHE", str(tmp_path / "cache"))


def sqnr_db(reference, result):
    reference, result = reference.double(), result.double()
    return 10 * math.log10(reference.pow(2).sum() / (reference - result).pow(2).sum())


# -- the range guard ------------------------------------------------------------------------------------------


def test_row_exponents_bound_every_output_and_count_the_guarded_rows():
    torch.manual_seed(0)
    k = 16384
    a = torch.randn(6, k)
    a[1] = 1e4 * (1 + 0.1 * torch.rand(k))  # huge and flat: normalising its largest value is not enough
    a[3] = 1.9  # equal values: L1 = k * amax, so the output bound exceeds fp16's range after normalising
    a[5] = 0.0
    exp, guarded = row_exponents(a, weight_absmax=1.9, normalize=True)
    scaled = scale_rows(a, exp).float()
    assert guarded == 2
    assert (scaled.abs().sum(1) * 1.9 <= LIMIT).all()  # no output element (or partial sum) can overflow
    assert (scaled.abs().sum(1)[[1, 3]] * 1.9 > LIMIT / 2).all()  # and the guard shifted no further than needed
    amax = scaled.abs().amax(1)
    assert (amax[[0, 2, 4]] >= 1).all() and (amax[[0, 2, 4]] < 2).all()  # the other rows are only normalised
    for row in range(5):
        assert sqnr_db(a[row], unscale_rows(scaled, exp)[row]) > 60  # scaling back is exact up to fp16 rounding
    # no normalisation asked and no overflow possible: rows are left exactly as they are
    exp0, guarded0 = row_exponents(a[[0, 2]], weight_absmax=1e-3, normalize=False)
    assert guarded0 == 0 and not exp0.any()


@needs_qnn
def test_qnn_guard_keeps_huge_rows_finite_and_accurate():
    qnn = get_backend("qnn")
    k, n = 32768, 16
    torch.manual_seed(1)
    weight = quantize(6.0 + 0.06 * torch.rand(n, k))
    x = torch.randn(4, k) * 0.1
    x[1], x[2] = 3e4, -7e6  # rows whose L1 norm overflows fp16 outputs even after normalising
    handle = qnn.prepare(weight)
    # the case is real: normalising each row's largest value alone leaves outputs beyond fp16's range
    exp_norm = torch.frexp(x.abs().amax(1, keepdim=True)).exponent - 1
    normalised = scale_rows(x, exp_norm).float() @ (weight.dequantize() * 2.0**handle.weight_exp).t()
    assert normalised[[1, 2]].abs().min() > 65504 and normalised[[0, 3]].abs().max() < 65504
    before = qnn.counts["guarded_rows"]
    y = qnn.forward(x, handle)
    assert qnn.counts["guarded_rows"] - before == 2
    assert torch.isfinite(y).all()
    y_ref = x.double() @ weight.dequantize(torch.float64).t()
    for row in range(4):
        assert sqnr_db(y_ref[row], y[row]) >= 60, row
    dy = torch.rand(3, n)
    assert sqnr_db(dy.double() @ weight.dequantize(torch.float64), qnn.input_grad(dy, handle)) >= 60


# -- 16-bit layers --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp16_layer_skips_dequantization_and_equals_the_dense_product(dtype):
    torch.manual_seed(2)
    linear = torch.nn.Linear(64, 48).to(dtype)
    layer = FrozenLinear.from_linear(linear, precision="fp16")
    stored = torch.bfloat16 if dtype == torch.bfloat16 else torch.float16
    assert layer.weight.dtype == stored and layer.weight.shape == (48, 64) and "weight_scale" not in layer.state_dict()
    x = torch.randn(5, 64, dtype=dtype, requires_grad=True)
    y = layer(x)
    w = linear.weight.detach().to(stored).to(dtype)
    torch.testing.assert_close(y, x @ w.t() + linear.bias, atol=0, rtol=0)
    y.backward(torch.ones_like(y))
    torch.testing.assert_close(x.grad, torch.ones_like(y) @ w, atol=0, rtol=0)
    assert layer.backend.counts == {"forward": 1, "input_grad": 1}


@needs_qnn
def test_fp16_layer_on_qnn_runs_every_node_on_the_npu():
    qnn = get_backend("qnn", cache=False)
    torch.manual_seed(3)
    layer = FrozenLinear.from_linear(torch.nn.Linear(64, 80), backend=qnn, precision="fp16")
    x = torch.randn(7, 64, requires_grad=True)
    y = layer(x)
    y.sum().backward()
    w = layer.weight.double()
    assert sqnr_db(x.detach().double() @ w.t(), y.detach() - layer.bias) >= 60
    assert sqnr_db(torch.ones(7, 80).double() @ w, x.grad) >= 60
    placement = qnn.graph_placement()
    assert {("forward", 80, 64, 16, "fp16"), ("input_grad", 80, 64, 16, "fp16")} <= set(placement)
    for key, placed in placement.items():
        assert list(placed) == [qnn_module.EP_NAME], key
        assert key[4] == "fp16" and "Gather" not in placed[qnn_module.EP_NAME], key  # no dequantizer in the graph


# -- the probe and the plan -----------------------------------------------------------------------------------


def _batch():
    torch.manual_seed(4)
    ids = torch.randint(0, 128, (2, 16))
    return {"input_ids": ids, "labels": ids}


SENSITIVE = "model.layers.1.mlp.up_proj"


def _snapped_model():
    """Every frozen linear but one already holds NVFP4-representable weights (quantizing is idempotent)."""
    model = tiny_model("llama")
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and name != SENSITIVE and name != "lm_head":
                module.weight.copy_(quantize(module.weight).dequantize())
    return model


def test_probe_finds_the_layer_nvfp4_hurts_most_and_leaves_the_model_as_it_was():
    model = _snapped_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    config = PactConfig(r=4, target_modules="all-linear", init_lora_weights="gaussian")
    sens = {s.name: s for s in probe_precision(model, _batch(), config)}
    assert len(sens) == 14
    moved = {name for name, s in sens.items() if s.output_error or s.input_grad_error or s.adapter_grad_change}
    assert moved == {SENSITIVE}  # NVFP4 changes nothing where the weight is representable: exactly zero
    s = sens[SENSITIVE]
    assert 0.01 < s.output_error < 0.3 and 0.01 < s.input_grad_error < 0.3 and s.adapter_grad_change > 1e-3
    assert plan_precision(sens.values(), math.inf) == {name: "fp16" if name == SENSITIVE else "nvfp4" for name in sens}
    assert not any(isinstance(m, LoraLayer) for m in model.modules())
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert all(p.requires_grad for p in model.parameters())  # a fresh model trains all; the probe restored that


def test_plan_respects_the_budget_and_is_reproducible():
    layers = [
        LayerSensitivity("a", 64, 64, 0.1, 0.1, 0.5),
        LayerSensitivity("b", 64, 64, 0.1, 0.1, 0.2),
        LayerSensitivity("c", 128, 64, 0.1, 0.1, 0.5),
        LayerSensitivity("d", 64, 64, 0.1, 0.1, 0.0),
    ]
    small = layers[0].fp16_premium_bytes / 2**20
    assert plan_precision(layers, 0) == dict.fromkeys("abcd", "nvfp4")
    assert plan_precision(layers, small) == {"a": "fp16", "b": "nvfp4", "c": "nvfp4", "d": "nvfp4"}
    assert plan_precision(layers, math.inf) == {"a": "fp16", "b": "fp16", "c": "fp16", "d": "nvfp4"}
    with pytest.raises(ValueError, match="budget_mib=-1"):
        plan_precision(layers, -1)


def test_plan_is_applied_saved_in_pact_config_json_and_reused(tmp_path):
    model = _snapped_model()
    config = PactConfig(r=4, target_modules="all-linear")
    premium = 128 * 64 * (2 - 0.5625) / 2**20
    planned = config.with_precision_plan(model, _batch(), budget_mib=premium * 1.5, adapter_grads=False)
    assert planned.precision_plan[SENSITIVE] == "fp16"
    assert list(planned.precision_plan.values()).count("fp16") == 1
    peft_model = get_peft_model(model, planned)
    layers = {n: m for n, m in peft_model.named_modules() if isinstance(m, FrozenLinear)}
    assert layers["base_model.model.model.layers.1.mlp.up_proj.base_layer"].precision == "fp16"
    assert sum(m.precision == "fp16" for m in layers.values()) == 1
    peft_model.save_pretrained(tmp_path)
    reloaded = PactConfig.from_pretrained(tmp_path)
    assert reloaded.precision_plan == planned.precision_plan and reloaded.precision_budget_mib == premium * 1.5
    again = get_peft_model(tiny_model("llama"), reloaded)
    assert [m.precision for m in again.modules() if isinstance(m, FrozenLinear)] == [
        m.precision for m in layers.values()
    ]


def test_probe_needs_adapters_and_plans_need_known_precisions():
    with pytest.raises(ValueError, match="trainable"):
        model = tiny_model("llama")
        model.requires_grad_(False)
        probe_sensitivity(model, _batch())
    with pytest.raises(ValueError, match="precision_plan"):
        PactConfig(precision_plan={"model.layers.0.mlp.up_proj": "int3"})


def test_fp16_plan_on_an_already_quantized_model_is_a_clear_error():
    model = get_peft_model(tiny_model("llama"), PactConfig(r=4, target_modules="all-linear"))
    base = model.unload()
    with pytest.raises(ValueError, match="already"):
        get_peft_model(
            base, PactConfig(r=4, target_modules=["up_proj"], precision_plan={"model.layers.0.mlp.up_proj": "fp16"})
        )


# -- backend choice and options -------------------------------------------------------------------------------


def test_auto_picks_torch_on_an_emulated_npu_and_says_why(caplog):
    with caplog.at_level("INFO", logger="optimum_pact.backends"):
        backend = get_backend("auto", tile_size=None)
    assert backend.name == "torch"
    assert "chose 'torch'" in caplog.text and ("emulator" in caplog.text or "not installed" in caplog.text)


@needs_qnn
def test_auto_picks_qnn_where_the_htp_is_real_hardware(monkeypatch):
    monkeypatch.setattr("platform.machine", lambda: "aarch64")
    assert get_backend("auto", tile_size=None, soc_model="60").name == "qnn"
    config = PactConfig(r=4, target_modules=["q_proj", "up_proj"], backend="auto")
    model = get_peft_model(tiny_model("llama"), config)
    backends = {id(m.backend): m.backend for m in model.modules() if isinstance(m, FrozenLinear)}
    assert list(backends.values()) == [config.get_backend()]  # "auto" resolved once, for the whole model
    assert config.get_backend().name == "qnn" and "started" in config.get_backend().reason


@needs_qnn
def test_backend_options_reach_the_backend():
    config = PactConfig(r=4, target_modules=["q_proj"], backend="qnn", backend_options={"soc_model": "60"})
    model = get_peft_model(tiny_model("llama"), config)
    backends = {id(m.backend): m.backend for m in model.modules() if isinstance(m, FrozenLinear)}
    assert len(backends) == 1 and next(iter(backends.values())) is config.get_backend()  # ONE QnnBackend
    assert config.get_backend().soc_model == "60"


@needs_qnn
def test_aqlora_model_on_qnn_holds_one_backend_whose_counts_are_the_models():
    config = PactConfig(r=4, target_modules="all-linear", backend="qnn", protect_fraction=0.5, adapt="speed")
    model = get_peft_model(tiny_model("llama"), config)
    frozen = [m for m in model.modules() if isinstance(m, FrozenLinear)]
    assert {m.precision for m in frozen} == {"nvfp4", "fp16"}  # protected and quantized layers alike
    assert {id(m.backend) for m in frozen} == {id(config.get_backend())}
    model(input_ids=torch.tensor([[1, 2, 3, 4]]), labels=torch.tensor([[1, 2, 3, 4]])).loss.backward()
    counts = config.get_backend().counts
    assert counts["forward"] == len(frozen) and 0 < counts["input_grad"] < len(frozen)  # speed: backward stops early


def test_unknown_backend_option_is_a_clear_error():
    with pytest.raises(ValueError, match="no option soc_model='60'"):
        get_peft_model(
            tiny_model("llama"), PactConfig(r=4, target_modules=["q_proj"], backend_options={"soc_model": "60"})
        )
    with pytest.raises(ValueError, match="backend_options"):
        PactConfig(backend_options=["soc_model"])


def test_auto_dtype_is_bf16_only_where_the_cpu_computes_it_natively():
    import platform
    from pathlib import Path

    from optimum_pact.precision import resolve_dtype

    auto = resolve_dtype("auto")
    if platform.machine() == "x86_64":  # the CPU's own word: AVX512-BF16 or AMX, or bf16 is emulated
        flags = Path("/proc/cpuinfo").read_text()
        assert auto == (torch.bfloat16 if "avx512_bf16" in flags or "amx_bf16" in flags else torch.float32)
    assert resolve_dtype("float32") == torch.float32 and resolve_dtype(torch.float16) == torch.float16
    with pytest.raises(ValueError, match="dtype='half' is not one of auto, bfloat16, float32"):
        resolve_dtype("half")
