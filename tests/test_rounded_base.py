"""The person's own base (`--rounding gptq`): GPTQ codes taken on their items, saved beside the adapter, and the
model every use of the adapter builds computes the training-time logits exactly."""

import pytest
import torch
from test_pact_quick import _full_logits, _quick_logits, _used
from test_use_path import _logits, _train_time_model
from transformers import AutoModelForCausalLM

from optimum_pact.commands.calibration import input_hessians
from optimum_pact.commands.export import export_merged
from optimum_pact.commands.modeling import PactModelForCausalLM
from optimum_pact.commands.rounded_base import BASE_FILE, apply_codes, frozen_linears, gptq_base, read_codes
from optimum_pact.nvfp4 import quantize
from optimum_pact.nvfp4.gptq import gptq_quantize_many
from optimum_pact.quantizer import PactQuantizationConfig
from peft_ext.blocks import decoder_linears

ROWS = [[1, 520, 1742, 314, 2283, 30, 88, 4, 17, 900], [5, 61, 700, 2], [9, 1200, 31, 77, 402, 13, 8]] * 3


def _same(a, b) -> bool:
    return torch.equal(a.qdata, b.qdata) and torch.equal(a.scale.float(), b.scale.float()) and a.scale_2 == b.scale_2


def test_block_by_block_gives_the_codes_of_gptq_on_the_whole_models_moments(small_model):
    model = AutoModelForCausalLM.from_pretrained(small_model, dtype=torch.float32)
    layers = decoder_linears(model)
    moments = input_hessians(model, layers, sorted(ROWS, key=len), batch_size=4)  # it batches rows by length
    expected = dict(zip(layers, gptq_quantize_many([(layer.weight, moments[n]) for n, layer in layers.items()])))
    codes = gptq_base(model, ROWS, small_model, batch_size=4)
    assert sorted(codes) == sorted(layers)
    assert all(_same(codes[name], expected[name]) for name in layers)
    assert any(not _same(codes[name], quantize(layer.weight)) for name, layer in layers.items())  # not nearest
    # a base loaded packed (two linears kept 16-bit) runs each block on the checkpoint's weights: the same codes
    sixteen = ["model.layers.0.mlp.down_proj", "model.layers.1.self_attn.q_proj"]
    packed = AutoModelForCausalLM.from_pretrained(
        small_model, dtype=torch.float32, quantization_config=PactQuantizationConfig(modules_in_16bit=sixteen)
    )
    streamed = gptq_base(packed, ROWS, small_model, batch_size=4)
    assert sorted(streamed) == sorted(set(layers) - set(sixteen))
    assert all(_same(streamed[name], expected[name]) for name in streamed)


def _rounded_adapter(base, out, dtype, seed, **pact):
    """`_train_time_model` on a base rounded by GPTQ on ROWS, its codes saved beside the adapter."""
    return _train_time_model(base, out, dtype, seed, rounded_on=ROWS, **pact)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_the_use_path_and_the_quick_path_run_the_rounded_base_exactly(small_model, tmp_path, dtype):
    trained, folder = _rounded_adapter(small_model, tmp_path / "a", dtype, 0, protect_fraction=0.25, rank_by="nvfp4")
    assert len(read_codes(folder / BASE_FILE)) == 10  # the 14 linears less the protected quarter
    used, quick = _used(small_model, folder)
    torch.testing.assert_close(_logits(used.model), _logits(trained), atol=0, rtol=0)
    ids = used.prompt_ids("Leo lost another tooth")
    tokens, full = _full_logits(used, ids)
    for a, b in zip(_quick_logits(quick.decoder, ids, tokens), full):
        assert torch.equal(a, b)
    # the negative control: the same adapter on the shared (nearest) base computes something else
    (folder / BASE_FILE).unlink()
    shared = PactModelForCausalLM.from_pretrained(str(small_model), adapter=str(folder))
    assert not torch.equal(_logits(shared.model), _logits(trained))


def test_adapters_on_their_own_bases_and_the_shared_one_each_run_as_trained(small_model, tmp_path):
    dtype = torch.bfloat16
    a, folder_a = _rounded_adapter(small_model, tmp_path / "a", dtype, 1)
    b, folder_b = _train_time_model(small_model, tmp_path / "b", dtype, 2)  # the shared, nearest-rounded base
    expected = {"a": _logits(a), "b": _logits(b)}
    used = PactModelForCausalLM.from_pretrained(str(small_model), adapter={"b": str(folder_b), "a": str(folder_a)})
    for name in ("b", "a", "b", "a"):
        used.set_adapter(name)
        torch.testing.assert_close(_logits(used.model), expected[name], atol=0, rtol=0, msg=name)
    # a is active: the shared base's codes of its 14 NVFP4 linears are held aside
    layers = decoder_linears(AutoModelForCausalLM.from_pretrained(small_model))
    aside = sum(
        m.in_features * m.out_features // 2 + m.in_features * m.out_features // 16 + 4 for m in layers.values()
    )
    assert used.precisions.extra_bytes() == aside


def test_the_merged_export_starts_from_the_rounded_base(small_model, tmp_path):
    trained, folder = _rounded_adapter(small_model, tmp_path / "a", torch.float32, 3)
    exact = {}  # what training computed with: the rounded base's weights plus the adapter's change
    for name, module in trained.named_modules():
        if name.endswith("proj") and hasattr(module, "get_delta_weight"):
            base = module.get_base_layer().dequantize(torch.float32)
            exact[name.removeprefix("base_model.model.")] = base + module.get_delta_weight("default").float()

    def off(folder_out) -> float:  # the share of merged weights farther from `exact` than a bf16 rounding of theirs
        merged = AutoModelForCausalLM.from_pretrained(export_merged(folder, folder_out, str(small_model)))
        far = [(merged.get_submodule(n).weight.float() - w).abs() > w.abs() / 128 + 1e-7 for n, w in exact.items()]
        return float(sum(f.sum() for f in far) / sum(f.numel() for f in far))

    rounded = off(tmp_path / "merged")  # bf16 roundings only (far only where base and change nearly cancel)
    (folder / BASE_FILE).unlink()  # the nearest base instead: NVFP4 steps away from what was trained
    nearest = off(tmp_path / "merged2")
    assert rounded < 0.005 and nearest > 10 * rounded, (rounded, nearest)


def test_damaged_or_mismatched_codes_are_refused_by_name(small_model, tmp_path):
    _, folder = _rounded_adapter(small_model, tmp_path / "a", torch.bfloat16, 4)
    codes = read_codes(folder / BASE_FILE)
    name = next(iter(codes))
    wrong = {name: quantize(torch.randn(32, 64))}
    model = AutoModelForCausalLM.from_pretrained(small_model, quantization_config=PactQuantizationConfig())
    with pytest.raises(ValueError, match=f"codes of {name} are \\(32, 64\\)"):
        apply_codes(model, wrong)
    (folder / BASE_FILE).write_bytes(b"not safetensors")
    with pytest.raises(ValueError, match=f"{BASE_FILE} could not be read"):
        read_codes(folder / BASE_FILE)


def test_the_main_job_saves_its_rounding_beside_the_adapter_and_nearest_saves_none(small_model, tmp_path, capsys):
    from optimum_pact.commands.cli import main

    args = ["finetune", "--model", str(small_model), "--max-steps", "1", "--dtype", "float32"]
    assert main([*args, "--output", str(tmp_path / "gptq")]) == 0
    assert "GPTQ: 10 NVFP4 linears rounded on 240 training items" in capsys.readouterr().err  # 14 less 4 kept 16-bit
    codes = read_codes(tmp_path / "gptq" / "adapter" / BASE_FILE)
    used = PactModelForCausalLM.from_pretrained(str(small_model), adapter=str(tmp_path / "gptq" / "adapter"))
    layers = {name: layer for name, (_, layer) in frozen_linears(used.model).items()}
    assert sorted(codes) == sorted(n for n, m in layers.items() if m.precision == "nvfp4")
    assert all(_same(layers[name].nvfp4, q) for name, q in codes.items())
    assert main([*args, "--output", str(tmp_path / "nearest"), "--rounding", "nearest"]) == 0
    assert not (tmp_path / "nearest" / "adapter" / BASE_FILE).exists()
    with pytest.raises(SystemExit):
        main([*args, "--rounding", "exact"])
    assert "--rounding: invalid choice: 'exact'" in capsys.readouterr().err
