"""PACT's model-side options as TrainingArguments: PactTrainer puts a plain-LoRA (or bare) model on PACT's base."""

import json

import pytest
import torch
from conftest import tiny_model
from datasets import Dataset
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file

from optimum_pact.backends.qnn import is_qnn_available
from optimum_pact.dataflow import FrozenLinear
from peft_ext import PACT_CONFIG_NAME, PactConfig
from peft_ext.blocks import lowest_trainable_block
from trainer_callbacks import PactTrainer, PactTrainingArguments

LAYERS = 4  # the speed setting adapts the top half: blocks 2 and 3
LINEARS = 7 * LAYERS


def _data():
    ids = torch.randint(0, 128, (8, 16), generator=torch.Generator().manual_seed(0))
    return Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})


def _args(tmp_path, **kw):
    defaults = dict(max_steps=4, learning_rate=1e-2, per_device_train_batch_size=4, logging_steps=1, seed=0)
    return PactTrainingArguments(
        output_dir=str(tmp_path), report_to="none", use_cpu=True, save_strategy="no", disable_tqdm=True,
        **{**defaults, **kw},
    )  # fmt: skip


def _frozen(model):
    return {name: m for name, m in model.named_modules() if isinstance(m, FrozenLinear)}


def _train(model, args, out):
    trainer = PactTrainer(model=model, args=args, train_dataset=_data())
    trainer.train()
    trainer.model.save_pretrained(out)
    return trainer


def test_plain_lora_model_gets_nvfp4_aqlora_and_speed_from_the_arguments_alone(tmp_path):
    lora = LoraConfig(r=4, target_modules="all-linear")
    options = {"protect_fraction": 0.2, "adapt": "speed", "rank_by": "nvfp4"}  # ("auto" would calibrate: below)
    by_args = _train(
        get_peft_model(tiny_model(num_hidden_layers=LAYERS), lora),
        _args(tmp_path / "a", pact_backend="torch", **{f"pact_{k}": v for k, v in options.items()}),
        tmp_path / "args",
    )
    by_config = _train(
        get_peft_model(tiny_model(num_hidden_layers=LAYERS), PactConfig(r=4, target_modules="all-linear", **options)),
        _args(tmp_path / "b"),
        tmp_path / "config",
    )
    model = by_args.model
    frozen = _frozen(model)
    assert len(frozen) == LINEARS and sum(m.precision == "fp16" for m in frozen.values()) == round(0.2 * LINEARS)
    assert lowest_trainable_block(model) == LAYERS // 2  # no adapter, so no backward graph, below the top half
    backend = model.peft_config["default"].get_backend()
    assert {id(m.backend) for m in frozen.values()} == {id(backend)}
    assert backend.counts == by_config.model.peft_config["default"].get_backend().counts  # the same products
    assert backend.counts["input_grad"] < backend.counts["forward"] / 2  # backward stopped at the adapted blocks

    # the same adapter, bit for bit, as PactConfig with the same options and seed; plain PEFT + pact_config.json
    trained, reference = (
        load_file(tmp_path / "args" / "adapter_model.safetensors"),
        load_file(tmp_path / "config" / "adapter_model.safetensors"),
    )
    assert trained.keys() == reference.keys() and all(".layers.2." in k or ".layers.3." in k for k in trained)
    for key in trained:
        torch.testing.assert_close(trained[key], reference[key], atol=0, rtol=0)
    sidecar = json.loads((tmp_path / "args" / PACT_CONFIG_NAME).read_text())
    assert sidecar == json.loads((tmp_path / "config" / PACT_CONFIG_NAME).read_text())
    assert sidecar["adapt"] == "speed" and len(sidecar["protected_modules"]) == round(0.2 * LINEARS)
    stock = PeftModel.from_pretrained(tiny_model(num_hidden_layers=LAYERS), tmp_path / "args")  # stock peft
    loaded = {n: p for n, p in stock.named_parameters() if "lora_" in n}
    assert len(loaded) == len(trained) and not _frozen(stock)
    for name, p in loaded.items():
        key = name.replace(".default.weight", ".weight")
        torch.testing.assert_close(p, trained[key], atol=0, rtol=0)


def test_adapter_weights_carry_over_unchanged(tmp_path):
    model = get_peft_model(tiny_model(), LoraConfig(r=4, target_modules=["q_proj", "up_proj"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_()  # a trained-looking adapter: B is no longer zero
    before = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}
    trainer = PactTrainer(model=model, args=_args(tmp_path, pact_nvfp4_base=True), train_dataset=_data())
    after = {n: p for n, p in trainer.model.named_parameters() if "lora_" in n}
    assert after.keys() == before.keys()
    for name in before:
        torch.testing.assert_close(after[name], before[name], atol=0, rtol=0)
    assert len(_frozen(trainer.model)) == 2 * 2  # q_proj and up_proj of both blocks


def test_a_model_without_pact_options_trains_as_it_is(tmp_path):
    model = get_peft_model(tiny_model(), LoraConfig(r=4, target_modules=["q_proj"]))
    trainer = PactTrainer(model=model, args=_args(tmp_path), train_dataset=_data())
    assert trainer.model is model and not _frozen(model)


def test_arguments_that_disagree_with_the_models_pact_config_are_refused(tmp_path):
    model = get_peft_model(tiny_model(), PactConfig(r=4, target_modules=["q_proj"], protect_fraction=0.5))
    with pytest.raises(ValueError) as err:
        PactTrainer(
            model=model, args=_args(tmp_path, pact_protect_fraction=0.2, pact_adapt="speed"), train_dataset=_data()
        )
    message = str(err.value)
    assert "pact_protect_fraction=0.2 but the model's PactConfig.protect_fraction=0.5" in message
    assert "pact_adapt='speed' but the model's PactConfig.adapt='quality'" in message
    agreeing = PactTrainer(model=model, args=_args(tmp_path, pact_protect_fraction=0.5), train_dataset=_data())
    assert agreeing.model is model


def test_a_bare_model_gets_its_decoder_linears_on_the_backend(tmp_path):
    trainer = PactTrainer(model=tiny_model(), args=_args(tmp_path, pact_protect_fraction=0.5), train_dataset=_data())
    frozen = _frozen(trainer.model)
    assert len(frozen) == 14 and sum(m.precision == "fp16" for m in frozen.values()) == 7
    assert len({id(m.backend) for m in frozen.values()}) == 1
    with pytest.raises(ValueError, match="pact_adapt='speed' needs LoRA adapters"):
        PactTrainer(model=tiny_model(), args=_args(tmp_path, pact_adapt="speed"), train_dataset=_data())


@pytest.mark.skipif(not is_qnn_available(), reason="needs onnxruntime-qnn (optimum-pact[qnn])")
def test_plain_lora_on_qnn_from_the_arguments_runs_every_product_on_the_npu(tmp_path, monkeypatch):
    monkeypatch.setenv("PACT_CACHE", str(tmp_path / "cache"))
    model = get_peft_model(tiny_model(), LoraConfig(r=4, target_modules="all-linear"))
    trainer = _train(model, _args(tmp_path, pact_backend="qnn", max_steps=2), tmp_path / "adapter")
    backend = trainer.model.peft_config["default"].get_backend()
    assert backend.name == "qnn"
    assert {type(m.backend).__name__ for m in _frozen(trainer.model).values()} == {"QnnBackend"}
    assert {id(m.backend) for m in _frozen(trainer.model).values()} == {id(backend)}
    assert backend.counts["forward"] >= 2 * 14 and backend.counts["input_grad"] >= 2 * 11
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    assert all(loss == loss for loss in losses)  # finite through fp16 on the NPU
    assert json.loads((tmp_path / "adapter" / PACT_CONFIG_NAME).read_text())["backend"] == "qnn"
