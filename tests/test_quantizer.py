"""The `pact` transformers quantizer: quantize-on-load, ModelOpt-layout save, exact reload, config validation."""

from __future__ import annotations

import inspect
import json
import logging
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config
from transformers.quantizers import AutoHfQuantizer, AutoQuantizationConfig, HfQuantizer

import optimum_pact.quantizer as pact_quantizer
from optimum_pact.dataflow.linear import FrozenLinear
from optimum_pact.quantizer import PactHfQuantizer, PactQuantizationConfig

VOCAB = 128
DECODER_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def llama_config(**overrides) -> LlamaConfig:
    kwargs = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=VOCAB,
        tie_word_embeddings=False,
    )
    return LlamaConfig(**{**kwargs, **overrides})


def qwen2_config() -> Qwen2Config:
    return Qwen2Config(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        tie_word_embeddings=False,
    )


def save_random_model(config, path) -> str:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # random biases too (Qwen2 q/k/v), so a dropped bias shows up
        for module in model.modules():
            if isinstance(module, nn.Linear) and module.bias is not None:
                module.bias.normal_()
    model.save_pretrained(path)
    return str(path)


def frozen_layers(model) -> dict[str, FrozenLinear]:
    return {name: module for name, module in model.named_modules() if isinstance(module, FrozenLinear)}


def same_nvfp4(a: FrozenLinear, b: FrozenLinear) -> bool:
    return (
        torch.equal(a.weight, b.weight)
        and torch.equal(a.weight_scale.view(torch.uint8), b.weight_scale.view(torch.uint8))
        and torch.equal(a.weight_scale_2, b.weight_scale_2)
    )


def logits(model, seed: int = 1) -> torch.Tensor:
    ids = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model(ids).logits


@pytest.fixture(params=["llama", "qwen2"])
def checkpoint(request, tmp_path):
    config = llama_config() if request.param == "llama" else qwen2_config()
    return save_random_model(config, tmp_path / "fp32")


def test_quantize_on_load_matches_from_linear_and_dequantized_reference(checkpoint):
    model = AutoModelForCausalLM.from_pretrained(checkpoint, quantization_config=PactQuantizationConfig())
    reference = AutoModelForCausalLM.from_pretrained(checkpoint)

    frozen = frozen_layers(model)
    assert sorted({name.rsplit(".", 1)[1] for name in frozen}) == sorted(DECODER_LINEARS)
    assert len(frozen) == 2 * len(DECODER_LINEARS)
    assert type(model.lm_head) is nn.Linear
    assert not any(type(m) is nn.Linear for n, m in model.named_modules() if n != "lm_head")
    assert model.config.quantization_config.quant_method == "pact"
    assert model.hf_quantizer.is_trainable and model.hf_quantizer.is_serializable()

    for name, layer in frozen.items():
        linear = reference.get_submodule(name)
        assert same_nvfp4(layer, FrozenLinear.from_linear(linear)), name
        if linear.bias is not None:
            assert torch.equal(layer.bias, linear.bias) and not layer.bias.requires_grad, name
        with torch.no_grad():
            linear.weight.copy_(layer.dequantize(linear.weight.dtype))
    # Same effective weights: the logits agree exactly (atol=0).
    torch.testing.assert_close(logits(model), logits(reference), atol=0, rtol=0)


def test_save_writes_modelopt_layout_and_reload_is_exact(checkpoint, tmp_path, monkeypatch):
    model = AutoModelForCausalLM.from_pretrained(checkpoint, quantization_config=PactQuantizationConfig())
    saved = tmp_path / "pact"
    model.save_pretrained(saved)

    config = json.loads((saved / "config.json").read_text())
    assert config["quantization_config"] == {
        "quant_method": "pact",
        "backend": "torch",
        "backend_options": None,
        "modules_to_not_convert": None,
    }
    with safe_open(str(saved / "model.safetensors"), framework="pt") as f:
        dtypes = {key: f.get_slice(key).get_dtype() for key in f.keys()}
    for name, layer in frozen_layers(model).items():
        assert dtypes[f"{name}.weight"] == "U8"
        assert dtypes[f"{name}.weight_scale"] == "F8_E4M3"
        assert dtypes[f"{name}.weight_scale_2"] == "F32"
        assert (f"{name}.bias" in dtypes) == (layer.bias is not None)
    assert dtypes["lm_head.weight"] == "F32"
    assert not any(key.startswith("lm_head.weight_") for key in dtypes)

    def no_quantize(*args, **kwargs):
        raise AssertionError("a pact checkpoint must load without quantizing again")

    monkeypatch.setattr(pact_quantizer, "quantize", no_quantize)
    reloaded = AutoModelForCausalLM.from_pretrained(saved)  # config.json alone selects the pact quantizer
    assert isinstance(reloaded.hf_quantizer, PactHfQuantizer) and reloaded.hf_quantizer.pre_quantized
    assert frozen_layers(reloaded).keys() == frozen_layers(model).keys()
    for name, layer in frozen_layers(reloaded).items():
        assert same_nvfp4(layer, model.get_submodule(name)), name
        if layer.bias is not None:
            assert not layer.bias.requires_grad
    torch.testing.assert_close(logits(reloaded), logits(model), atol=0, rtol=0)


def test_linear_with_in_features_not_multiple_of_16_stays_unquantized(tmp_path, caplog):
    # head_dim 18: o_proj takes 4 * 18 = 72 inputs, every other decoder linear takes 64 or 128
    path = save_random_model(llama_config(head_dim=18), tmp_path / "fp32")
    with caplog.at_level(logging.WARNING, logger=pact_quantizer.__name__):
        model = AutoModelForCausalLM.from_pretrained(path, quantization_config=PactQuantizationConfig())
    lines = [r.getMessage() for r in caplog.records if r.name == pact_quantizer.__name__]
    assert len(lines) == 1
    assert "model.layers.0.self_attn.o_proj (in_features=72)" in lines[0]
    assert "model.layers.1.self_attn.o_proj (in_features=72)" in lines[0]
    assert "multiple of 16" in lines[0]

    for i in range(2):
        assert type(model.get_submodule(f"model.layers.{i}.self_attn.o_proj")) is nn.Linear
        assert isinstance(model.get_submodule(f"model.layers.{i}.self_attn.q_proj"), FrozenLinear)
    assert len(frozen_layers(model)) == 2 * (len(DECODER_LINEARS) - 1)

    saved = tmp_path / "pact"
    model.save_pretrained(saved)
    reloaded = AutoModelForCausalLM.from_pretrained(saved)
    assert type(reloaded.model.layers[0].self_attn.o_proj) is nn.Linear
    torch.testing.assert_close(logits(reloaded), logits(model), atol=0, rtol=0)


def test_modules_to_not_convert_and_options_survive_the_round_trip(tmp_path):
    path = save_random_model(llama_config(), tmp_path / "fp32")
    config = PactQuantizationConfig(
        backend_options={"tile_size": 32}, modules_to_not_convert=["mlp.down_proj", "model.layers.1"]
    )
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=config)
    assert sorted(frozen_layers(model)) == sorted(
        f"model.layers.0.{'mlp' if n in ('gate_proj', 'up_proj') else 'self_attn'}.{n}"
        for n in DECODER_LINEARS
        if n != "down_proj"
    )
    backends = {id(layer.backend): layer.backend for layer in frozen_layers(model).values()}
    assert len(backends) == 1 and next(iter(backends.values())).tile_size == 32  # one backend for the model

    model.save_pretrained(tmp_path / "pact")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "pact")
    assert reloaded.config.quantization_config.modules_to_not_convert == ["mlp.down_proj", "model.layers.1"]
    assert frozen_layers(reloaded).keys() == frozen_layers(model).keys()
    assert all(layer.backend.tile_size == 32 for layer in frozen_layers(reloaded).values())
    torch.testing.assert_close(logits(reloaded), logits(model), atol=0, rtol=0)


def test_bf16_load_quantizes_the_bf16_weight(tmp_path):
    path = save_random_model(qwen2_config(), tmp_path / "fp32")
    model = AutoModelForCausalLM.from_pretrained(
        path, quantization_config=PactQuantizationConfig(), dtype=torch.bfloat16
    )
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    for name, layer in frozen_layers(model).items():
        assert same_nvfp4(layer, FrozenLinear.from_linear(reference.get_submodule(name))), name
        if layer.bias is not None:
            assert layer.bias.dtype == torch.bfloat16


def test_lora_style_training_reaches_inputs_not_frozen_weights(tmp_path):
    path = save_random_model(qwen2_config(), tmp_path / "fp32")
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=PactQuantizationConfig())
    model.requires_grad_(False)
    model.lm_head.requires_grad_(True)
    embeds = model.get_input_embeddings()(torch.randint(0, VOCAB, (2, 7))).detach().requires_grad_(True)
    model(inputs_embeds=embeds).logits.square().mean().backward()
    assert model.lm_head.weight.grad is not None and embeds.grad is not None and embeds.grad.abs().sum() > 0
    assert all(p.grad is None for layer in frozen_layers(model).values() for p in layer.parameters())


def test_dequantize_gives_linears_with_the_effective_weights(tmp_path):
    path = save_random_model(llama_config(), tmp_path / "fp32")
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=PactQuantizationConfig())
    expected = logits(model)
    weights = {name: layer.dequantize() for name, layer in frozen_layers(model).items()}
    model = model.dequantize()
    assert not frozen_layers(model) and not hasattr(model.config, "quantization_config")
    for name, weight in weights.items():
        assert torch.equal(model.get_submodule(name).weight, weight)
    torch.testing.assert_close(logits(model), expected, atol=0, rtol=0)


def test_transformers_loading_contract(tmp_path, monkeypatch):
    """Fails loudly if transformers changes the on-the-fly quantization hooks this quantizer relies on."""
    from transformers.core_model_loading import ConversionOps

    assert issubclass(pact_quantizer.PactQuantize, ConversionOps)
    assert "input_dict" in inspect.signature(ConversionOps.convert).parameters
    for hook in ("param_needs_quantization", "get_quantize_ops", "_process_model_before_weight_loading"):
        assert hook in vars(HfQuantizer), f"HfQuantizer.{hook} is gone: review optimum_pact/quantizer.py"
    assert "add_default_skips" in inspect.signature(HfQuantizer.get_modules_to_not_convert).parameters

    # One conversion per quantized linear, each handed exactly one full-precision weight (streamed, not all at once).
    calls = []
    original = pact_quantizer.PactQuantize.convert

    def spy(self, input_dict, **kwargs):
        calls.append({key: value[0] if isinstance(value, list) else value for key, value in input_dict.items()})
        return original(self, input_dict, **kwargs)

    monkeypatch.setattr(pact_quantizer.PactQuantize, "convert", spy)
    path = save_random_model(llama_config(), tmp_path / "fp32")
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=PactQuantizationConfig())
    assert len(calls) == len(frozen_layers(model)) == 2 * len(DECODER_LINEARS)
    for call in calls:
        ((key, tensor),) = call.items()
        assert key.endswith(".weight") and tensor.dtype == torch.float32 and tensor.dim() == 2


def test_registration_and_config_round_trip():
    config = AutoQuantizationConfig.from_dict({"quant_method": "pact", "backend_options": {"tile_size": 64}})
    assert isinstance(config, PactQuantizationConfig) and config.backend_options == {"tile_size": 64}
    # optimum-pact 0.1 wrote tile_size as its own field: it reads back as the torch backend's option
    old = AutoQuantizationConfig.from_dict({"quant_method": "pact", "backend": "auto", "tile_size": 64})
    assert old.backend == "auto" and old.backend_options == {"tile_size": 64}
    assert isinstance(AutoHfQuantizer.from_config(config, pre_quantized=False), PactHfQuantizer)
    assert PactQuantizationConfig.from_dict(config.to_dict()).to_dict() == config.to_dict()


@pytest.mark.parametrize(
    ("kwargs", "error", "needles"),
    [
        ({"backend": "cuda-magic"}, ValueError, ["backend", "'cuda-magic'", "'torch'"]),
        ({"backend": None}, ValueError, ["backend", "None", "'torch'"]),
        ({"backend_options": "{"}, ValueError, ["backend_options", "JSON"]),
        ({"backend_options": ["tile_size"]}, ValueError, ["backend_options", "dict"]),
        ({"modules_to_not_convert": "lm_head"}, ValueError, ["modules_to_not_convert", "'lm_head'", "list"]),
        ({"modules_to_not_convert": ["lm_head", 3]}, ValueError, ["modules_to_not_convert", "3", "list"]),
        ({"tile": 64}, TypeError, ["tile", "backend_options"]),
        ({"quant_method": "fp8"}, ValueError, ["quant_method", "'fp8'"]),
    ],
)
def test_bad_config_values_raise_clear_errors(kwargs, error, needles):
    with pytest.raises(error) as info:
        PactQuantizationConfig(**kwargs)
    for needle in needles:
        assert needle in str(info.value), (needle, str(info.value))


def test_importing_the_package_imports_no_optional_package_and_the_config_registers_the_quantizer():
    code = (
        "import sys, optimum_pact\n"
        "optional = ('peft', 'onnxruntime', 'onnx', 'bitsandbytes', 'gguf', 'torchao', 'transformers.quantizers')\n"
        "loaded = sorted(m for m in optional if m in sys.modules)\n"
        "assert not loaded, loaded\n"  # transformers.quantizers imports torchao, which logs as it loads
        "from optimum_pact import PactQuantizationConfig\n"
        "from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING, AUTO_QUANTIZER_MAPPING\n"
        "assert AUTO_QUANTIZATION_CONFIG_MAPPING['pact'] is PactQuantizationConfig\n"
        "assert AUTO_QUANTIZER_MAPPING['pact'].__name__ == 'PactHfQuantizer'\n"
        "loaded = sorted(m for m in ('peft', 'onnxruntime', 'onnx', 'bitsandbytes', 'gguf') if m in sys.modules)\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_tied_embeddings_and_device_map_keep_lm_head_tied_and_unquantized(tmp_path):
    path = save_random_model(llama_config(tie_word_embeddings=True), tmp_path / "fp32")
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=PactQuantizationConfig(), device_map="cpu")
    assert type(model.lm_head) is nn.Linear and model.lm_head.weight is model.get_input_embeddings().weight
    assert len(frozen_layers(model)) == 2 * len(DECODER_LINEARS)
    model.save_pretrained(tmp_path / "pact")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "pact", device_map="cpu")
    assert reloaded.lm_head.weight is reloaded.get_input_embeddings().weight
    torch.testing.assert_close(logits(reloaded), logits(model), atol=0, rtol=0)


def test_the_output_head_gets_its_input_with_plain_strides(checkpoint):
    """Generation's prompt logits come from `lm_head(hidden[:, -1:, :])`, a slice that keeps the prompt's batch
    stride, which torch 2.13's CPU linear takes down a slow path (optimum_pact/head.py). A PACT-loaded model hands
    its head the same values with plain strides; the logits are unchanged."""
    model = AutoModelForCausalLM.from_pretrained(checkpoint, quantization_config=PactQuantizationConfig())
    seen = []
    model.lm_head.register_forward_pre_hook(lambda module, args: seen.append(args[0].stride()))
    ids = torch.randint(0, VOCAB, (1, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        last = model(ids, logits_to_keep=1).logits
        full = model(ids).logits
    hidden = model.config.hidden_size
    assert seen[0] == (hidden, hidden, 1)  # not (7 * hidden, hidden, 1)
    torch.testing.assert_close(last, full[:, -1:])


def test_the_output_head_decodes_through_the_native_kernel(checkpoint, monkeypatch):
    """Decoding's one row goes through `head_product` (the native kernel's dense mode) with the head's own weight: the
    head stays an nn.Linear, its logits are torch's within fp32 summation order; many rows and training keep torch's
    product."""
    from optimum_pact.nvfp4.kernels import NativeLinear

    model = AutoModelForCausalLM.from_pretrained(checkpoint, quantization_config=PactQuantizationConfig())
    weight = model.lm_head.weight
    assert type(model.lm_head) is nn.Linear
    head_rows = []
    real = NativeLinear.run

    def record(self, x):
        if self._keep[0].data_ptr() == weight.data_ptr():
            head_rows.append(x.shape)
        return real(self, x)

    monkeypatch.setattr(NativeLinear, "run", record)
    ids = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(ids).logits  # 12 rows, more than FUSED_MAX_ROWS: torch's product
        assert head_rows == []
        last = model(ids, logits_to_keep=1).logits
    assert head_rows == [(1, 1, model.config.hidden_size)]
    torch.testing.assert_close(last, full[:, -1:])
    model(ids, logits_to_keep=1).logits.sum().backward()  # grad mode: torch's product, gradients flow
    assert head_rows == [(1, 1, model.config.hidden_size)] and weight.grad is not None
