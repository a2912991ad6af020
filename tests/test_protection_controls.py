"""The AQLoRA benchmarks' random-protection controls and the memory premium of protection."""

import sys
from pathlib import Path

import pytest
from conftest import tiny_model
from peft import get_peft_model

from optimum_pact.dataflow import FrozenLinear
from peft_ext import PactConfig
from peft_ext.blocks import decoder_linears
from peft_ext.ranking import choose_protected

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from protection_controls import matched_random_protected, protection_premium_mib, random_protected  # noqa: E402


def test_random_control_is_seeded_and_memory_matched():
    names = [f"layer{i}" for i in range(20)]
    first = random_protected(names, 5, seed=1)
    assert first == random_protected(list(reversed(names)), 5, seed=1)  # the input order does not matter
    assert len(first) == 5 and set(first) <= set(names)
    assert any(random_protected(names, 5, seed=s) != first for s in range(2, 6))
    with pytest.raises(ValueError, match=r"count=21 must be an integer in \[0, 20\]"):
        random_protected(names, 21)

    model = tiny_model("llama", num_hidden_layers=4)
    protected = choose_protected(model, 0.25, "nvfp4")
    control = matched_random_protected(model, protected, seed=0)
    assert len(control) == len(protected) and control != sorted(protected)
    assert protection_premium_mib(model, control) == pytest.approx(protection_premium_mib(model, protected))
    assert control == matched_random_protected(model, protected, seed=0)


def test_premium_is_bf16_bytes_minus_the_packed_nvfp4_bytes():
    model = tiny_model("llama")
    protected = ["model.layers.0.mlp.down_proj", "model.layers.1.self_attn.k_proj"]
    layers = decoder_linears(model)
    expected = (
        sum(layers[n].weight.numel() * 2 - FrozenLinear.from_linear(layers[n]).nvfp4.nbytes for n in protected) / 2**20
    )
    assert protection_premium_mib(model, protected) == pytest.approx(expected, rel=1e-12)
    with pytest.raises(ValueError, match="not decoder linears"):
        protection_premium_mib(model, ["lm_head"])
    quantized = get_peft_model(model, PactConfig(r=4, target_modules="all-linear"))  # shapes suffice afterwards
    assert protection_premium_mib(quantized, protected) == pytest.approx(expected, rel=1e-12)
