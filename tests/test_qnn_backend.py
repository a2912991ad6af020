"""The qnn backend on the QNN HTP backend (on x86_64: the HTP emulator, real HTP numerics), against the torch oracle.

SQNR thresholds: the graphs compute in fp16 (11 significant bits, ~66 dB for one rounding of a random signal).
fp32 inputs must reach 60 dB against the float64 oracle; bf16 inputs are limited by bf16's own 8 bits (the torch
backend in bf16 reaches ~55 dB too), so they must reach 45 dB and be no more than 3 dB below the torch backend.
"""

import glob
import json
import math
import subprocess
import sys

import pytest
import torch
from conftest import tiny_model, train_lm

from optimum_pact.backends import BACKENDS, BackendUnavailableError, get_backend
from optimum_pact.backends import qnn as qnn_module
from optimum_pact.dataflow import FrozenLinear
from optimum_pact.nvfp4 import quantize

needs_qnn = pytest.mark.skipif(not qnn_module.is_qnn_available(), reason="needs onnxruntime-qnn (optimum-pact[qnn])")
QNN = qnn_module.EP_NAME
# QNN JSON graph dump codes (QnnTypes.h): tensor types and data types
APP_WRITE, STATIC = 0, 4
QNN_UINT8, QNN_FP16 = 0x0108, 0x0216


def sqnr_db(reference: torch.Tensor, result: torch.Tensor) -> float:
    reference, result = reference.double(), result.double()
    return 10 * math.log10(reference.pow(2).sum() / (reference - result).pow(2).sum())


def _products(backend, weight, x, dy):
    handle = backend.prepare(weight)
    return backend.forward(x, handle), backend.input_grad(dy, handle)


@pytest.fixture(scope="module", autouse=True)
def private_graph_cache(tmp_path_factory):
    # compiled graphs go to a temporary cache, not ~/.cache/optimum_pact/qnn
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PACT_CACHE", str(tmp_path_factory.mktemp("pact_cache")))
        yield


@pytest.fixture(scope="module")
def qnn():
    if not qnn_module.is_qnn_available():
        pytest.skip("needs onnxruntime-qnn (optimum-pact[qnn])")
    return get_backend("qnn")


@needs_qnn
@pytest.mark.parametrize("n, k, tokens", [(80, 64, (3, 7)), (48, 96, (33,)), (64, 32, (1,))])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_products_agree_with_torch_backend(qnn, n, k, tokens, dtype):
    torch.manual_seed(0)
    weight = quantize(torch.randn(n, k) * 0.05)
    x, dy = torch.randn(*tokens, k, dtype=dtype), torch.randn(*tokens, n, dtype=dtype)
    y, dx = _products(qnn, weight, x, dy)
    assert y.dtype == dx.dtype == dtype and y.shape == (*tokens, n) and dx.shape == (*tokens, k)
    oracle = get_backend("torch")
    y_ref, dx_ref = _products(oracle, weight, x.double(), dy.double())  # float64 oracle on the same inputs
    if dtype == torch.float32:
        assert sqnr_db(y_ref, y) >= 60, f"forward SQNR {sqnr_db(y_ref, y):.1f} dB < 60 dB (fp16 on HTP)"
        assert sqnr_db(dx_ref, dx) >= 60, f"input-grad SQNR {sqnr_db(dx_ref, dx):.1f} dB < 60 dB (fp16 on HTP)"
    else:
        y_t, dx_t = _products(oracle, weight, x, dy)
        for name, ref, got, torch_got in (("forward", y_ref, y, y_t), ("input grad", dx_ref, dx, dx_t)):
            ours, theirs = sqnr_db(ref, got), sqnr_db(ref, torch_got)
            assert ours >= 45 and ours >= theirs - 3, f"{name}: qnn {ours:.1f} dB vs torch bf16 {theirs:.1f} dB"


@needs_qnn
@pytest.mark.parametrize("w_scale, a_scale", [(1e-5, 1.0), (1e3, 1.0), (0.05, 1e-7), (0.05, 1e3)])
def test_power_of_two_normalisation_keeps_fp16_in_range(qnn, w_scale, a_scale):
    # tiny gradients (1e-7) would be fp16 subnormals or zero, and large weights x activations would overflow fp16;
    # the per-call and per-weight power-of-two scaling keeps the fp16 graphs at full precision
    torch.manual_seed(1)
    weight = quantize(torch.randn(64, 48) * w_scale)
    x, dy = torch.randn(20, 48) * a_scale, torch.randn(20, 64) * a_scale
    y, dx = _products(qnn, weight, x, dy)
    y_ref, dx_ref = _products(get_backend("torch"), weight, x.double(), dy.double())
    assert torch.isfinite(y).all() and torch.isfinite(dx).all()
    assert sqnr_db(y_ref, y) >= 60, f"forward SQNR {sqnr_db(y_ref, y):.1f} dB < 60 dB"
    assert sqnr_db(dx_ref, dx) >= 60, f"input-grad SQNR {sqnr_db(dx_ref, dx):.1f} dB < 60 dB"


@needs_qnn
def test_each_token_keeps_its_precision_next_to_a_huge_one(qnn):
    # one token 1e7 times larger than the others: a per-call scale would push the small ones into fp16 subnormals
    torch.manual_seed(6)
    weight = quantize(torch.randn(64, 48))
    x, dy = torch.randn(9, 48) * 1e-3, torch.randn(9, 64) * 1e-3
    x[4] *= 1e7
    dy[4] *= 1e7
    y, dx = _products(qnn, weight, x, dy)
    y_ref, dx_ref = _products(get_backend("torch"), weight, x.double(), dy.double())
    for row in range(9):
        assert sqnr_db(y_ref[row], y[row]) >= 60, f"forward row {row}: {sqnr_db(y_ref[row], y[row]):.1f} dB"
        assert sqnr_db(dx_ref[row], dx[row]) >= 60, f"input-grad row {row}: {sqnr_db(dx_ref[row], dx[row]):.1f} dB"


@needs_qnn
def test_static_shapes_pad_to_power_of_two_buckets_and_chunk():
    backend = get_backend("qnn", min_tokens=8, max_tokens=32)
    assert [backend.bucket(t) for t in (1, 8, 9, 17, 32)] == [8, 8, 16, 32, 32]
    torch.manual_seed(2)
    weight = quantize(torch.randn(32, 48))
    handle = backend.prepare(weight)
    x = torch.randn(75, 48)  # two chunks of 32 tokens and one of 11 (bucket 16)
    y = backend.forward(x, handle)
    y_ref = get_backend("torch").forward(x.double(), get_backend("torch").prepare(weight))
    assert sqnr_db(y_ref, y) >= 60
    buckets = {key[3] for key in backend.graph_placement() if key[:3] == ("forward", 32, 48)}
    assert buckets == {16, 32}
    assert torch.equal(backend.forward(x[:0], handle), x.new_empty(0, 32))


@needs_qnn
def test_every_node_of_every_graph_runs_on_qnn():
    qnn = get_backend("qnn", cache=False)  # graphs compiled here, not loaded from the cache: placement per node
    torch.manual_seed(3)
    layer = FrozenLinear.from_linear(torch.nn.Linear(64, 80), backend=qnn)
    x = torch.randn(2, 5, 64, requires_grad=True)
    layer(x).sum().backward()
    placement = qnn.graph_placement()
    assert {("forward", 80, 64, 16, "nvfp4"), ("input_grad", 80, 64, 16, "nvfp4")} <= set(placement)
    for (product, n, k, bucket, weight_format), placed in placement.items():
        graph = qnn_module.build_product_graph(product, n, k, bucket, weight_format).graph
        graph_ops = sorted(node.op_type for node in graph.node)
        assert list(placed) == [QNN], f"{product} {n}x{k}: nodes placed on {list(placed)}"
        assert sorted(placed[QNN]) == graph_ops  # every node, the dequantizer included, on QNN


@needs_qnn
def test_a_node_qnn_cannot_run_is_an_error_not_a_cpu_fallback():
    from onnx import TensorProto, helper

    # BitShift is not supported by the QNN EP: with CPU fallback it would silently run on the CPU
    graph = helper.make_graph(
        [helper.make_node("BitShift", ["a", "b"], ["c"], direction="RIGHT")],
        "unsupported",
        [helper.make_tensor_value_info(n, TensorProto.UINT8, [16]) for n in ("a", "b")],
        [helper.make_tensor_value_info("c", TensorProto.UINT8, [16])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    with pytest.raises(Exception, match="fallback to CPU EP has been explicitly disabled"):
        qnn_module.make_session(model, "60")


def _qnn_graphs(folder) -> list[dict]:
    files = [f for f in sorted(glob.glob(f"{folder}/*.json")) if not f.endswith("_tensor_log.json")]
    return [json.loads(open(f).read())["graph"] for f in files]


@needs_qnn
def test_qnn_receives_the_packed_weight_not_a_folded_dequantized_one(tmp_path):
    n, k = 48, 64
    dump = {"dump_json_qnn_graph": "1", "json_qnn_graph_dir": str(tmp_path)}
    backend = get_backend("qnn", provider_options=dump, cache=False)
    handle = backend.prepare(quantize(torch.randn(n, k)))
    backend.forward(torch.randn(5, k), handle)
    backend.input_grad(torch.randn(5, n), handle)
    graphs = _qnn_graphs(tmp_path)
    assert len(graphs) == 2
    for graph in graphs:
        tensors = graph["tensors"]
        assert (tensors["packed"]["type"], tensors["packed"]["data_type"]) == (APP_WRITE, QNN_UINT8)
        assert tensors["packed"]["dims"] == [n, k // 2]
        assert (tensors["scale_bytes"]["type"], tensors["scale_bytes"]["dims"]) == (APP_WRITE, [n, k // 16])
        assert tensors["scale_table"]["type"] == APP_WRITE
        static = {name: math.prod(t["dims"]) for name, t in tensors.items() if t["type"] == STATIC}
        assert max(static.values()) <= 512, static  # the 256 x 2 pair table; nothing of weight size
        ops = sorted(node["type"] for node in graph["nodes"].values())
        assert ops.count("Gather") == 2 and ops.count("Cast") == 2  # the dequantizer runs on the NPU
        assert ("FullyConnected" in ops) != ("MatMul" in ops) and "Transpose" not in ops

    # the check is able to fail: with the weight as initializers, ONNX Runtime folds the unpacking before QNN
    from onnx import numpy_helper

    model = qnn_module.build_product_graph("forward", n, k, 16)
    model.graph.initializer.extend(
        numpy_helper.from_array(t.numpy(), name) for name, t in zip(qnn_module.WEIGHT_INPUTS, handle.tensors)
    )
    kept = [i for i in model.graph.input if i.name not in qnn_module.WEIGHT_INPUTS]
    del model.graph.input[:]
    model.graph.input.extend(kept)
    folded = tmp_path / "folded"
    folded.mkdir()
    qnn_module.make_session(model, "60", {"dump_json_qnn_graph": "1", "json_qnn_graph_dir": str(folded)})
    (graph,) = _qnn_graphs(folded)
    static = [t for t in graph["tensors"].values() if t["type"] == STATIC and math.prod(t["dims"]) == n * k]
    assert static and static[0]["data_type"] == QNN_FP16
    assert "Gather" not in {node["type"] for node in graph["nodes"].values()}


@needs_qnn
def test_lora_finetune_on_qnn_tracks_torch_backend():
    from peft import get_peft_model

    from peft_ext import PactConfig

    curves = {}
    for backend in ("torch", "qnn"):
        model = get_peft_model(tiny_model("llama"), PactConfig(r=4, target_modules="all-linear", backend=backend))
        frozen = [m for m in model.modules() if isinstance(m, FrozenLinear)]
        assert len(frozen) == 14 and all(m.backend.name == backend for m in frozen)
        curves[backend] = train_lm(model, steps=10)
    torch_curve, qnn_curve = curves["torch"], curves["qnn"]
    assert qnn_curve[-1] < qnn_curve[0] - 0.5, qnn_curve  # it learns
    gaps = [abs(a - b) for a, b in zip(torch_curve, qnn_curve)]
    # fp16 products on the NPU vs fp32 on the CPU: the curves stay within 0.2% of the loss (measured: 0.012%)
    assert max(g / t for g, t in zip(gaps, torch_curve)) < 0.002, (torch_curve, qnn_curve)


def test_qnn_is_a_registered_backend_that_imports_nothing_until_built():
    assert "qnn" in BACKENDS
    code = (
        "import sys, optimum_pact, optimum_pact.backends.qnn; "
        "assert not [m for m in sys.modules if m.startswith(('onnx', 'onnxruntime'))], sorted(sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_missing_onnxruntime_qnn_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(qnn_module, "is_qnn_available", lambda: False)
    with pytest.raises(BackendUnavailableError, match=r"pip install optimum-pact\[qnn\]"):
        get_backend("qnn")


def test_pact_finetune_with_qnn_missing_is_a_clear_cli_error(monkeypatch, capsys):
    from optimum_pact.commands.cli import main

    monkeypatch.setattr(qnn_module, "is_qnn_available", lambda: False)
    assert main(["finetune", "--backend", "qnn", "--model", "./no/such/model"]) == 2
    assert "pip install optimum-pact[qnn]" in capsys.readouterr().err


@pytest.mark.parametrize("soc_model", ["abc", "", -1, 6.0, True])
def test_malformed_soc_model_is_a_clear_error(soc_model):
    with pytest.raises(ValueError, match="soc_model=.* is invalid; pass the Snapdragon SoC id"):
        get_backend("qnn", soc_model=soc_model)


@needs_qnn
def test_unsupported_soc_model_is_a_clear_error():
    with pytest.raises(ValueError, match="soc_model='9999' is not supported by this QNN HTP backend"):
        get_backend("qnn", soc_model=9999)


@pytest.mark.parametrize(
    "options, match",
    [
        ({"tile_size": 64}, "backend='qnn' has no option tile_size=64"),
        ({"min_tokens": 12}, "min_tokens=12 must be a positive power of two"),
        ({"max_tokens": 0}, "max_tokens=0 must be a positive power of two"),
        ({"min_tokens": 64, "max_tokens": 32}, "min_tokens=64 exceeds max_tokens=32"),
        ({"provider_options": {"soc_model": "43"}}, "set by the backend"),
        ({"cache": "yes"}, "cache='yes' must be True or False"),
        ({"cache": False, "cache_dir": "/tmp/x"}, "cache_dir='/tmp/x' is set but cache=False"),
    ],
)
def test_bad_options_are_clear_errors(options, match):
    with pytest.raises(ValueError, match=match):
        get_backend("qnn", **options)


def _cache_entries(folder) -> list:
    return sorted(p.name for p in folder.iterdir())


@needs_qnn
def test_compiled_graphs_are_cached_on_disk_and_reloaded(tmp_path):
    torch.manual_seed(4)
    weight = quantize(torch.randn(48, 64))
    x, dy = torch.randn(5, 64), torch.randn(5, 48)
    first = get_backend("qnn", cache_dir=tmp_path)
    y, dx = _products(first, weight, x, dy)
    entries = _cache_entries(tmp_path)
    assert len(entries) == 4 and sum(e.endswith("_ctx.onnx") for e in entries) == 2, entries

    second = get_backend("qnn", cache_dir=tmp_path)  # a new instance: nothing compiled in memory
    y2, dx2 = _products(second, weight, x, dy)
    assert torch.equal(y, y2) and torch.equal(dx, dx2)
    placement = second.graph_placement()
    assert len(placement) == 2 and all(placed == {QNN: ["EPContext"]} for placed in placement.values())
    assert _cache_entries(tmp_path) == entries

    # another soc_model or other EP options compile their own entries: a stale one is never used
    _products(get_backend("qnn", cache_dir=tmp_path, soc_model=69), weight, x, dy)
    burst = {"htp_performance_mode": "burst"}
    _products(get_backend("qnn", cache_dir=tmp_path, provider_options=burst), weight, x, dy)
    assert len(_cache_entries(tmp_path)) == 12


@needs_qnn
@pytest.mark.parametrize("damage", ["flip", "truncate", "drop_checksum"])
def test_corrupted_cache_entry_is_rebuilt_with_a_warning(tmp_path, caplog, damage):
    torch.manual_seed(5)
    weight = quantize(torch.randn(48, 64))
    x = torch.randn(5, 64)
    backend = get_backend("qnn", cache_dir=tmp_path)
    y = backend.forward(x, backend.prepare(weight))
    (ctx,) = tmp_path.glob("*_ctx.onnx")
    blob = ctx.read_bytes()
    if damage == "flip":
        ctx.write_bytes(blob[:-100] + bytes([blob[-100] ^ 0x01]) + blob[-99:])
    elif damage == "truncate":
        ctx.write_bytes(blob[: len(blob) // 2])
    else:
        ctx.with_name(ctx.name + ".sha256").unlink()

    backend = get_backend("qnn", cache_dir=tmp_path)  # a new instance: nothing compiled in memory
    with caplog.at_level("WARNING", logger="optimum_pact.backends.qnn_cache"):
        y2 = backend.forward(x, backend.prepare(weight))
    assert "is corrupted" in caplog.text and "rebuilding it" in caplog.text
    assert torch.equal(y, y2)
    assert backend.graph_placement()[("forward", 48, 64, 16, "nvfp4")][QNN] != ["EPContext"]  # compiled again
    caplog.clear()
    backend = get_backend("qnn", cache_dir=tmp_path)  # the rebuilt entry is sound
    with caplog.at_level("WARNING", logger="optimum_pact.backends.qnn_cache"):
        assert torch.equal(backend.forward(x, backend.prepare(weight)), y)
    assert not caplog.text
