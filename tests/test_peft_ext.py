"""PactConfig is a drop-in for LoraConfig: same script, NVFP4 data-flow base, plain PEFT files."""

import json
import logging

import pytest
import torch
from conftest import tiny_model, train_lm
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.lora import Linear as LoraLinear

from optimum_pact.dataflow import FrozenLinear
from peft_ext import PACT_CONFIG_NAME, PactConfig, PactLoraLinear


@pytest.mark.parametrize("config_cls", [LoraConfig, PactConfig])
def test_swap_is_the_only_change(arch, config_cls):
    # a plain peft script; the parametrization swaps only the config class
    model = get_peft_model(tiny_model(arch), config_cls(r=4, target_modules="all-linear"))
    losses = train_lm(model)
    assert losses[-1] < losses[0] - 0.5, losses
    frozen = [m for m in model.modules() if isinstance(m, FrozenLinear)]
    assert len(frozen) == (14 if config_cls is PactConfig else 0)  # 7 linears x 2 blocks


def test_targeted_linears_hold_no_floating_weight(arch):
    model = get_peft_model(tiny_model(arch), PactConfig(r=4, target_modules=["q_proj", "down_proj"]))
    wrapped = [m for m in model.modules() if isinstance(m, PactLoraLinear)]
    assert len(wrapped) == 4
    for m in wrapped:
        base = m.get_base_layer()
        assert isinstance(base, FrozenLinear) and base.weight.dtype == torch.uint8
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)


def test_forward_is_base_product_plus_adapter(arch):
    model = get_peft_model(tiny_model(arch), PactConfig(r=4, target_modules=["q_proj"], init_lora_weights=False))
    layer = next(m for m in model.modules() if isinstance(m, PactLoraLinear))
    x = torch.randn(3, 64)
    base = layer.get_base_layer()
    expected = base(x) + layer.lora_B["default"](layer.lora_A["default"](x)) * layer.scaling["default"]
    torch.testing.assert_close(layer(x), expected, atol=0, rtol=0)


def test_saved_adapter_loads_in_stock_peft_on_unquantized_base(tmp_path, arch):
    model = get_peft_model(
        tiny_model(arch), PactConfig(r=4, target_modules="all-linear", backend_options={"tile_size": 32})
    )
    train_lm(model, steps=3)
    model.save_pretrained(tmp_path)
    adapter_config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert adapter_config["peft_type"] == "LORA" and "backend" not in adapter_config
    pact = json.loads((tmp_path / PACT_CONFIG_NAME).read_text())
    assert pact == PactConfig(backend_options={"tile_size": 32}, base_dtype="float32").pact_dict()
    assert pact["backend"] == "torch" and pact["backend_options"] == {"tile_size": 32}

    stock = PeftModel.from_pretrained(tiny_model(arch), tmp_path)
    stock_layers = [m for m in stock.modules() if isinstance(m, LoraLinear)]
    assert stock_layers and not any(isinstance(m, PactLoraLinear) for m in stock_layers)
    trained = {n: p for n, p in model.named_parameters() if "lora_" in n}
    loaded = {n: p for n, p in stock.named_parameters() if "lora_" in n}
    assert trained.keys() == loaded.keys()
    for name in trained:
        torch.testing.assert_close(loaded[name], trained[name], atol=0, rtol=0)

    config = PactConfig.from_pretrained(str(tmp_path))
    assert isinstance(config, PactConfig) and config.backend_options == {"tile_size": 32} and config.r == 4
    resumed = PeftModel.from_pretrained(tiny_model(arch), tmp_path, config=config)
    assert any(isinstance(m, PactLoraLinear) for m in resumed.modules())


def test_linear_with_in_features_not_multiple_of_16_stays_unquantized(caplog):
    # intermediate_size=120: down_proj has in_features 120
    model = tiny_model("llama", intermediate_size=120)
    with caplog.at_level(logging.WARNING, logger="peft_ext.layer"):
        model = get_peft_model(model, PactConfig(r=4, target_modules=["down_proj", "up_proj"]))
    down = model.base_model.model.model.layers[0].mlp.down_proj
    up = model.base_model.model.model.layers[0].mlp.up_proj
    assert type(down) is LoraLinear and isinstance(down.get_base_layer(), torch.nn.Linear)
    assert isinstance(up.get_base_layer(), FrozenLinear)
    assert "in_features=120 is not a multiple of 16" in caplog.text


def test_merge_raises_a_clear_error():
    model = get_peft_model(tiny_model(), PactConfig(r=4, target_modules=["q_proj"]))
    with pytest.raises(NotImplementedError, match="merge_and_unload"):
        model.merge_and_unload()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"backend": "npu"}, "backend='npu'.*torch"),
        ({"backend_options": '{"tile_size": 40'}, "backend_options=.*not valid JSON"),
        ({"protect_fraction": 1.5}, "protect_fraction=1.5"),
        ({"adapt_top_blocks": 2}, "adapt_top_blocks=2 applies to adapt='speed'"),
    ],
)
def test_bad_config_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PactConfig(**kwargs)


def test_upstream_custom_module_hook_still_dispatches():
    # PactConfig relies on LoraConfig._register_custom_module (private API): fail loudly if upstream changes it
    config = PactConfig(r=4, target_modules=["q_proj"])
    assert config._custom_modules and torch.nn.Linear in config._custom_modules
    model = get_peft_model(tiny_model(), config)
    assert isinstance(model.base_model.model.model.layers[0].self_attn.q_proj, PactLoraLinear)


def test_pact_config_on_a_model_loaded_through_the_quantizer(tmp_path):
    from transformers import AutoModelForCausalLM

    from optimum_pact.quantizer import PactQuantizationConfig

    tiny_model().save_pretrained(tmp_path / "base")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "base", quantization_config=PactQuantizationConfig())
    packed = {n: m.weight.clone() for n, m in model.named_modules() if isinstance(m, FrozenLinear)}
    # peft's "all-linear" shorthand matches nn.Linear only: name the projections for a pre-quantized model
    names = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = get_peft_model(model, PactConfig(r=4, target_modules=names))
    wrapped = {n: m for n, m in model.named_modules() if isinstance(m, PactLoraLinear)}
    assert len(wrapped) == len(packed) == 14
    for name, layer in wrapped.items():  # the loaded NVFP4 weight is reused as is, not quantized twice
        assert torch.equal(layer.get_base_layer().weight, packed[name.removeprefix("base_model.model.")])
    losses = train_lm(model, steps=20)
    assert losses[-1] < losses[0] - 0.5
