"""What was trained is what runs: an adapter's 16-bit linears (AQLoRA, the precision plan) and the dtype its base was
built in come back wherever it is used, so the use path computes the training-time model's logits exactly."""

import json

import pytest
import torch
from peft import get_peft_model
from transformers import AutoModelForCausalLM

from optimum_pact.commands.export import export_merged
from optimum_pact.commands.modeling import PactModelForCausalLM
from optimum_pact.commands.nvfp4_merge import merged_weights, modelopt_config
from optimum_pact.dataflow import FrozenLinear
from optimum_pact.nvfp4 import NVFP4Tensor
from optimum_pact.quantizer import PactQuantizationConfig
from peft_ext import PactConfig

IDS = torch.tensor([[1, 520, 1742, 314, 2283, 30, 88, 4], [5, 61, 700, 2, 9, 1200, 31, 77]])
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]


def _train_time_model(base_folder, out, dtype, seed, rounded_on=None, **pact):
    """A PactConfig adapter with random non-zero B on the base loaded in `dtype`, saved to `out`: the training-time
    model (in eval mode) and its saved folder. `rounded_on`: token rows the base is rounded on by GPTQ first, as
    `pact finetune --rounding gptq` does (its codes saved beside the adapter)."""
    from optimum_pact.commands.rounded_base import apply_codes, gptq_base, save_codes

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base_folder, dtype=dtype)
    codes = gptq_base(model, rounded_on, base_folder) if rounded_on else {}
    config = PactConfig(r=4, target_modules="all-linear", init_lora_weights=False, **pact)
    model = get_peft_model(model, config)
    used = apply_codes(model, codes)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(20)
    model.save_pretrained(out)
    if used:
        save_codes(out, {name: codes[name] for name in used})
    return model.eval(), out


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS).logits


def _formats(model) -> dict[str, str]:
    return {
        n.removeprefix("base_model.model.").removesuffix(".base_layer"): m.precision
        for n, m in model.named_modules()
        if isinstance(m, FrozenLinear)
    }


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_the_use_path_computes_the_training_time_logits_exactly(small_model, tmp_path, dtype):
    trained, folder = _train_time_model(small_model, tmp_path / "a", dtype, 0, protect_fraction=0.25, rank_by="nvfp4")
    sixteen = trained.peft_config["default"].sixteen_bit_modules()
    assert len(sixteen) == 4  # a quarter of the 14 linears: the adapter records them
    sidecar = json.loads((folder / "pact_config.json").read_text())
    assert sidecar["base_dtype"] == str(dtype).removeprefix("torch.")
    assert sorted(sidecar["protected_modules"]) == sixteen

    used = PactModelForCausalLM.from_pretrained(str(small_model), adapter=str(folder))  # dtype "auto": as trained
    assert used.model.dtype == dtype
    assert _formats(used.model) == _formats(trained)  # the same linears 16-bit, the others NVFP4
    assert sorted(n for n, p in _formats(used.model).items() if p == "fp16") == sixteen
    torch.testing.assert_close(_logits(used.model), _logits(trained), atol=0, rtol=0)


def test_all_nvfp4_in_bf16_would_differ_so_the_test_above_can_fail(small_model, tmp_path):
    """The negative control: the old use path (every linear NVFP4, bf16) on an fp32 adapter with protected linears."""
    trained, folder = _train_time_model(small_model, tmp_path / "a", torch.float32, 0, protect_fraction=0.25)
    old = PactModelForCausalLM.from_pretrained(str(small_model), dtype="bfloat16")
    old.load_adapter(folder, "default")
    old.precisions.wanted["default"] = set()
    old.set_adapter("default")
    assert all(p == "nvfp4" for p in _formats(old.model).values())
    assert not torch.allclose(_logits(old.model).float(), _logits(trained), atol=1e-3)


def test_several_adapters_each_run_with_their_own_16bit_linears(small_model, tmp_path):
    dtype = torch.bfloat16
    attention = [f"model.layers.{i}.self_attn.{m}" for i in range(2) for m in ATTENTION]
    mlp = [f"model.layers.{i}.mlp.{m}" for i in range(2) for m in ("gate_proj", "up_proj")]
    a, folder_a = _train_time_model(small_model, tmp_path / "a", dtype, 1, protected_modules=attention)
    b, folder_b = _train_time_model(small_model, tmp_path / "b", dtype, 2, protected_modules=mlp)
    plain, folder_c = _train_time_model(small_model, tmp_path / "c", dtype, 3)  # all NVFP4
    expected = {"a": _logits(a), "b": _logits(b), "c": _logits(plain)}

    used = PactModelForCausalLM.from_pretrained(
        str(small_model), adapter={"a": str(folder_a), "b": str(folder_b), "c": str(folder_c)}
    )
    for name in ("a", "b", "c", "a", "c", "b"):
        used.set_adapter(name)
        wanted = {"a": attention, "b": mlp, "c": []}[name]
        assert sorted(n for n, p in _formats(used.model).items() if p == "fp16") == sorted(wanted), name
        torch.testing.assert_close(_logits(used.model), expected[name], atol=0, rtol=0, msg=name)
    # what the union costs: each of the 12 disputed linears held a second time, in the format not in use (b is active:
    # the attention linears' 16-bit copies and the MLP linears' NVFP4 ones are aside)
    layers = {n: used.model.get_base_model().get_submodule(n + ".base_layer") for n in mlp + attention}
    elements = {n: layer.in_features * layer.out_features for n, layer in layers.items()}
    dense = 2 * sum(elements[n] for n in attention)
    packed = sum(elements[n] // 2 + elements[n] // 16 + 4 for n in mlp)  # codes, e4m3 block scales, fp32 scale
    assert used.precisions.extra_bytes() == dense + packed


def test_merges_keep_the_16bit_linears_16bit_and_exact(small_model, tmp_path):
    trained, folder = _train_time_model(small_model, tmp_path / "a", torch.float32, 0, protect_fraction=0.25)
    sixteen = trained.peft_config["default"].sixteen_bit_modules()
    used = PactModelForCausalLM.from_pretrained(str(small_model), adapter=str(folder))
    weights, _ = merged_weights(used, "original", 0.0)
    assert sorted(n for n, w in weights.items() if not isinstance(w, NVFP4Tensor)) == sixteen
    for name in sixteen:  # W16 + B A, never rounded to 4 bits
        layer = used.model.get_submodule("base_model.model." + name)
        exact = layer.get_base_layer().dequantize(torch.float32) + layer.get_delta_weight("default").float()
        torch.testing.assert_close(weights[name], exact, atol=0, rtol=0)

    # merged-bf16: the training-time weights, merged; bf16 roundings only (an NVFP4 grid step is ~1/6 of a block's max)
    merged = AutoModelForCausalLM.from_pretrained(export_merged(folder, tmp_path / "m", str(small_model)))
    for name in sixteen:
        layer = used.model.get_submodule("base_model.model." + name)
        exact = layer.get_base_layer().dequantize(torch.float32) + layer.get_delta_weight("default").float()
        bound = exact.abs().max().item() / 128
        torch.testing.assert_close(merged.get_submodule(name).weight.float(), exact, atol=bound, rtol=1 / 128)

    # ModelOpt's exclude_modules names the 16-bit linears of a saved base
    quantization = PactQuantizationConfig(modules_in_16bit=sixteen)
    base = AutoModelForCausalLM.from_pretrained(small_model, quantization_config=quantization)
    excluded = modelopt_config(base)["quantization"]["exclude_modules"]
    assert set(sixteen) <= set(excluded) and "model.layers.0.mlp.down_proj" not in excluded


def test_a_16bit_name_the_base_lacks_is_refused(small_model):
    quantization = PactQuantizationConfig(modules_in_16bit=["model.layers.9.mlp.up_proj"])
    with pytest.raises(ValueError, match=r"modules_in_16bit names 1 module.*model.layers.9.mlp.up_proj.*trained on"):
        AutoModelForCausalLM.from_pretrained(small_model, quantization_config=quantization)


def test_on_a_saved_nvfp4_base_the_16bit_linears_run_nvfp4_and_it_says_so(small_model, tmp_path, caplog):
    from transformers import AutoTokenizer

    _, folder = _train_time_model(small_model, tmp_path / "a", torch.bfloat16, 0, protect_fraction=0.25)
    packed = tmp_path / "packed"  # the base saved as NVFP4: no full-precision weights to rebuild 16-bit linears from
    AutoModelForCausalLM.from_pretrained(small_model, quantization_config=PactQuantizationConfig()).save_pretrained(
        packed
    )
    AutoTokenizer.from_pretrained(small_model).save_pretrained(packed)
    with caplog.at_level("WARNING"):
        used = PactModelForCausalLM.from_pretrained(str(packed), adapter=str(folder))
    assert set(_formats(used.model).values()) == {"nvfp4"}
    assert "saved NVFP4 checkpoint" in caplog.text and "4 linears" in caplog.text
