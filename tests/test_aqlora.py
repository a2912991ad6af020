"""AQLoRA through PactConfig in plain peft code: protection by reconstruction error and the speed setting."""

import json

import pytest
import torch
from conftest import tiny_model, train_lm
from peft import PeftModel, get_peft_model

from optimum_pact.backends.torch_backend import TorchBackend
from optimum_pact.dataflow import FrozenLinear
from peft_ext import PactConfig
from peft_ext.ranking import choose_protected

BLOCKS = 4


def _model():
    return tiny_model("llama", num_hidden_layers=BLOCKS)


def _frozen(model):
    prefix = "base_model.model."
    return {
        n[len(prefix) : -len(".base_layer")]: m
        for n, m in model.named_modules()
        if isinstance(m, FrozenLinear) and n.endswith(".base_layer")
    }


def test_quality_protects_the_worst_layers_and_adapts_every_one():
    expected = choose_protected(_model(), 0.25)  # ranked on the unquantized weights alone
    model = get_peft_model(_model(), PactConfig(r=4, target_modules="all-linear", protect_fraction=0.25))
    frozen = _frozen(model)
    assert len(frozen) == 7 * BLOCKS and len(expected) == 7
    assert model.peft_config["default"].protected_modules == expected
    assert {n for n, m in frozen.items() if m.precision == "fp16"} == set(expected)
    assert all(m.weight.dtype == torch.uint8 for n, m in frozen.items() if n not in expected)
    assert sum("lora_A" in n for n, p in model.named_parameters() if p.requires_grad) == 7 * BLOCKS
    losses = train_lm(model, steps=15)
    assert losses[-1] < losses[0] - 0.5


def test_a_given_protected_list_is_kept_16_bit_without_a_protect_fraction():
    """protected_modules alone (as in a pact_config.json edited by hand, or a list ranked elsewhere) is honoured, not
    dropped because protect_fraction is at its default 0."""
    names = ["model.layers.0.mlp.down_proj", "model.layers.3.self_attn.q_proj"]
    model = get_peft_model(_model(), PactConfig(r=4, target_modules="all-linear", protected_modules=names))
    assert {n for n, m in _frozen(model).items() if m.precision == "fp16"} == set(names)
    assert model.peft_config["default"].protected_modules == names


def _block_outputs_need_grad(model):
    """Per block: whether its output hidden state is part of the autograd graph, recorded on the next forward."""
    seen = {}
    for i, block in enumerate(model.base_model.model.model.layers):
        block.register_forward_hook(
            lambda m, args, out, i=i: seen.__setitem__(i, (out[0] if isinstance(out, tuple) else out).requires_grad)
        )
    return seen


@pytest.mark.parametrize("checkpointing", [False, True])
def test_speed_adapts_the_top_blocks_and_backward_stops_below_them(checkpointing):
    model = get_peft_model(_model(), PactConfig(r=4, target_modules="all-linear", adapt="speed"))
    if checkpointing:  # transformers then adds the input-embedding hook that would drag backward to the bottom
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    trainable = {n.split(".layers.")[1].split(".")[0] for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {"2", "3"}  # default: the top half
    frozen = _frozen(model)
    assert len(frozen) == 7 * BLOCKS and all(m.precision == "nvfp4" for m in frozen.values())  # lower blocks too
    seen = _block_outputs_need_grad(model)
    for m in frozen.values():  # a backend of its own per layer, to count each layer's products
        m.backend, m._handle = TorchBackend(), None
    losses = train_lm(model, steps=10)
    assert losses[-1] < losses[0] - 0.3
    assert seen == {0: False, 1: False, 2: True, 3: True}  # no autograd graph, so no backward op, below block 2
    for name, m in frozen.items():
        block = int(name.split(".")[2])
        first_reads = block == 2 and name.endswith(("q_proj", "k_proj", "v_proj"))  # their input needs no gradient
        assert (m.backend.counts["input_grad"] > 0) == (block >= 2 and not first_reads), name
        assert m.backend.counts["forward"] > 0


def test_speed_adapter_loads_in_stock_peft_and_reloads_in_pact(tmp_path):
    config = PactConfig(r=4, target_modules="all-linear", adapt="speed", adapt_top_blocks=1, protect_fraction=0.1)
    model = get_peft_model(_model(), config)
    train_lm(model, steps=3)
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "adapter_config.json").read_text())
    assert saved["layers_to_transform"] == [3] and saved["layers_pattern"] == "layers"
    trained = {n: p for n, p in model.named_parameters() if "lora_" in n}
    stock = PeftModel.from_pretrained(_model(), tmp_path)
    loaded = {n: p for n, p in stock.named_parameters() if "lora_" in n}
    assert trained.keys() == loaded.keys() and len(trained) == 14
    assert all(torch.equal(trained[n], loaded[n]) for n in trained)

    reloaded = PactConfig.from_pretrained(tmp_path)
    assert reloaded.protected_modules == config.protected_modules and len(reloaded.protected_modules) == 3
    again = get_peft_model(_model(), reloaded)
    assert {n: m.precision for n, m in _frozen(again).items()} == {n: m.precision for n, m in _frozen(model).items()}


@pytest.mark.parametrize(
    "options, match",
    [
        ({"protect_fraction": 1.5}, r"protect_fraction=1.5 is outside the valid range \[0, 1\]"),
        ({"protect_fraction": -0.1}, "protect_fraction=-0.1"),
        ({"adapt": "fast"}, "adapt='fast'"),
        ({"rank_by": "int4"}, "rank_by='int4'"),
        ({"adapt_top_blocks": 2}, "applies to adapt='speed'"),
        ({"adapt": "speed", "adapt_top_blocks": 0}, "adapt_top_blocks=0"),
    ],
)
def test_bad_options_are_clear_errors(options, match):
    with pytest.raises(ValueError, match=match):
        PactConfig(r=4, **options)


def test_more_top_blocks_than_the_model_has_is_a_clear_error():
    with pytest.raises(ValueError, match="adapt_top_blocks=9 is larger than the model's 4 decoder blocks"):
        get_peft_model(_model(), PactConfig(r=4, target_modules="all-linear", adapt="speed", adapt_top_blocks=9))
