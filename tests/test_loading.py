"""Loading a pact checkpoint: nothing loads as garbage, no passed option is silently ignored (issue 17)."""

from __future__ import annotations

import inspect
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from test_quantizer import frozen_layers, llama_config, logits, save_random_model
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.quantizers import AutoHfQuantizer

import optimum_pact.quantizer as pact_quantizer
from optimum_pact.quantizer import PactHfQuantizer, PactQuantizationConfig

Q_PROJ = "model.layers.0.self_attn.q_proj"
UP_PROJ = "model.layers.1.mlp.up_proj"


@pytest.fixture(scope="module")
def saved_pact(tmp_path_factory) -> Path:
    """A pact checkpoint of the tiny llama (layer 1's MLP down projection kept in full precision)."""
    root = tmp_path_factory.mktemp("pact")
    path = save_random_model(llama_config(), root / "fp32")
    config = PactQuantizationConfig(modules_to_not_convert=["model.layers.1.mlp.down_proj"])
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=config)
    model.save_pretrained(root / "pact")
    return root / "pact"


@pytest.fixture
def pact_copy(saved_pact, tmp_path) -> Path:
    return Path(shutil.copytree(saved_pact, tmp_path / "pact"))


def edit_checkpoint(path: Path, edit) -> None:
    """Rewrite `path`'s model.safetensors with `edit(tensors)` applied (a dict of name -> tensor, edited in place)."""
    file = str(path / "model.safetensors")
    with safe_open(file, framework="pt") as f:
        metadata = f.metadata()
        tensors = {key: f.get_tensor(key) for key in f.keys()}
    edit(tensors)
    save_file(tensors, file, metadata=metadata)


def refusal(path, **kwargs) -> str:
    with pytest.raises(ValueError) as info:
        AutoModelForCausalLM.from_pretrained(path, **kwargs)
    return str(info.value)


# ---------------------------------------------------------------- a broken checkpoint is refused


def test_missing_packed_tensors_are_refused_naming_every_one(pact_copy):
    def drop(tensors):
        del tensors[f"{Q_PROJ}.weight_scale"]
        del tensors[f"{UP_PROJ}.weight_scale_2"]
        del tensors[f"{UP_PROJ}.weight"]

    edit_checkpoint(pact_copy, drop)
    message = refusal(pact_copy)
    for key in (f"{Q_PROJ}.weight_scale", f"{UP_PROJ}.weight_scale_2", f"{UP_PROJ}.weight"):
        assert f"{key}: missing from the checkpoint" in message, message
    assert f"{Q_PROJ}.weight:" not in message and f"{Q_PROJ}.weight_scale_2" not in message  # only what is wrong
    assert "save_pretrained" in message  # the fix


def test_unexpected_packed_tensors_are_refused_naming_every_one(pact_copy):
    def add(tensors):
        # down_proj of layer 1 was kept in full precision; lm_head is never converted
        tensors["model.layers.1.mlp.down_proj.weight_scale"] = torch.ones(64, 8).to(torch.float8_e4m3fn)
        tensors["lm_head.weight_scale_2"] = torch.ones((), dtype=torch.float32)

    edit_checkpoint(pact_copy, add)
    message = refusal(pact_copy)
    assert "model.layers.1.mlp.down_proj.weight_scale: unexpected" in message, message
    assert "lm_head.weight_scale_2: unexpected" in message, message
    assert "Linear" in message  # says what the layer is instead


@pytest.mark.parametrize(
    ("name", "bad", "stored", "expected"),
    [
        ("weight_scale", lambda t: t.to(torch.float16), "F16", "F8_E4M3"),  # today: silently cast back to fp8
        ("weight", lambda t: t.view(torch.int8), "I8", "U8"),
        ("weight_scale_2", lambda t: t.to(torch.float64), "F64", "F32"),
    ],
)
def test_a_packed_tensor_of_the_wrong_dtype_is_refused(pact_copy, name, bad, stored, expected):
    key = f"{Q_PROJ}.{name}"
    edit_checkpoint(pact_copy, lambda tensors: tensors.update({key: bad(tensors[key])}))
    message = refusal(pact_copy)
    assert f"{key}: stored as {stored}, must be {expected}" in message, message


@pytest.mark.parametrize("ignore_mismatched_sizes", [False, True])
def test_a_packed_tensor_of_the_wrong_shape_is_refused(pact_copy, ignore_mismatched_sizes):
    key = f"{Q_PROJ}.weight_scale"
    edit_checkpoint(pact_copy, lambda tensors: tensors.update({key: tensors[key][:, :-1].contiguous()}))
    message = refusal(pact_copy, ignore_mismatched_sizes=ignore_mismatched_sizes)
    assert f"{key}: shape [64, 3], must be [64, 4]" in message, message


@pytest.mark.parametrize("value", [0.0, float("nan"), float("inf"), -1.0])
def test_a_scale_2_that_is_not_a_finite_positive_number_is_refused(pact_copy, value):
    key = f"{UP_PROJ}.weight_scale_2"
    edit_checkpoint(pact_copy, lambda tensors: tensors.update({key: torch.tensor(value)}))
    message = refusal(pact_copy)
    assert f"{key}: {value}, must be a finite number > 0" in message, message


def test_nan_block_scales_are_refused(pact_copy):
    key = f"{Q_PROJ}.weight_scale"

    def poison(tensors):
        bits = tensors[key].view(torch.uint8).clone()
        bits[0, :3] = 0x7F  # e4m3fn NaN
        tensors[key] = bits.view(torch.float8_e4m3fn)

    edit_checkpoint(pact_copy, poison)
    message = refusal(pact_copy)
    assert f"{key}: 3 of 256 block scales are NaN" in message, message


def test_a_full_precision_weight_missing_from_the_source_checkpoint_is_refused(tmp_path):
    path = Path(save_random_model(llama_config(), tmp_path / "fp32"))
    edit_checkpoint(path, lambda tensors: tensors.pop(f"{Q_PROJ}.weight"))
    message = refusal(path, quantization_config=PactQuantizationConfig())
    for name in ("weight", "weight_scale", "weight_scale_2"):
        assert f"{Q_PROJ}.{name}: missing from the checkpoint" in message, message


def test_a_state_dict_missing_a_packed_tensor_is_refused(saved_pact):
    """No checkpoint file to read headers from: what the loader set is all there is to go on."""
    model = AutoModelForCausalLM.from_pretrained(saved_pact)
    state = {k: v for k, v in model.state_dict().items() if k != f"{Q_PROJ}.weight_scale"}
    with pytest.raises(ValueError) as info:
        type(model).from_pretrained(None, config=AutoConfig.from_pretrained(saved_pact), state_dict=state)
    assert f"{Q_PROJ}.weight_scale: missing from the checkpoint" in str(info.value), str(info.value)
    assert str(info.value).count("missing") == 1


def test_the_checkpoint_header_vouches_for_tensors_moved_after_loading(saved_pact, monkeypatch):
    """accelerate's dispatch may move a loaded tensor to another device, dropping the loader's mark on it: the
    checkpoint's header still says it was there, so an intact checkpoint loads."""
    monkeypatch.setattr(pact_quantizer, "_loaded_by_transformers", lambda tensor: False)
    model = AutoModelForCausalLM.from_pretrained(saved_pact)
    assert len(frozen_layers(model)) == 2 * 7 - 1
    torch.testing.assert_close(logits(model), logits(AutoModelForCausalLM.from_pretrained(saved_pact)))


# ---------------------------------------------------------------- options passed at reload are applied or refused


def test_reload_applies_the_passed_backend_options(saved_pact):
    config = PactQuantizationConfig(backend_options={"tile_size": 32})
    model = AutoModelForCausalLM.from_pretrained(saved_pact, quantization_config=config)
    assert model.hf_quantizer.pre_quantized
    backends = {id(layer.backend): layer.backend for layer in frozen_layers(model).values()}
    assert len(backends) == 1 and next(iter(backends.values())).tile_size == 32  # one shared backend
    assert model.config.quantization_config.backend_options == {"tile_size": 32}
    # the saved layout is kept: down_proj of layer 1 stays full precision
    assert model.config.quantization_config.modules_to_not_convert == ["model.layers.1.mlp.down_proj"]
    assert type(model.get_submodule("model.layers.1.mlp.down_proj")) is torch.nn.Linear
    torch.testing.assert_close(logits(model), logits(AutoModelForCausalLM.from_pretrained(saved_pact)))


def test_reload_refuses_a_different_modules_to_not_convert_naming_both(saved_pact):
    config = PactQuantizationConfig(modules_to_not_convert=["mlp.up_proj"])
    message = refusal(saved_pact, quantization_config=config)
    assert "modules_to_not_convert" in message
    assert "['mlp.up_proj']" in message and "['model.layers.1.mlp.down_proj']" in message, message


def test_reload_accepts_the_same_modules_to_not_convert(saved_pact):
    config = PactQuantizationConfig(modules_to_not_convert=["model.layers.1.mlp.down_proj"], backend="auto")
    model = AutoModelForCausalLM.from_pretrained(saved_pact, quantization_config=config)
    assert model.config.quantization_config.backend == "auto"
    assert model.hf_quantizer.backend.requested == "auto"


def test_transformers_reload_contract():
    """Fails loudly if transformers changes the two loading details the checks above rely on."""
    # 1. The loader marks every tensor it set from the checkpoint (and only those) with this attribute.
    assert pact_quantizer.LOADED_FLAG == "_is_hf_initialized"
    from transformers import core_model_loading

    assert f"param_value.{pact_quantizer.LOADED_FLAG} = True" in inspect.getsource(
        core_model_loading.set_param_for_module
    )
    # 2. get_hf_quantizer merges a passed config with the saved one through this classmethod, which we wrap.
    from transformers.quantizers import auto

    assert "AutoHfQuantizer.merge_quantization_configs(" in inspect.getsource(auto.get_hf_quantizer)
    assert getattr(AutoHfQuantizer.merge_quantization_configs, "__func__", None) is pact_quantizer._merge_configs
    # 3. The checkpoint files reach _process_model_before_weight_loading.
    from transformers import modeling_utils

    assert "checkpoint_files=checkpoint_files" in inspect.getsource(modeling_utils.PreTrainedModel.from_pretrained)
    assert isinstance(AutoHfQuantizer.from_config(PactQuantizationConfig()), PactHfQuantizer)
