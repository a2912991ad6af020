"""AQLoRA ranked by gradient sensitivity: the probe's score on a calibration batch decides what stays 16-bit."""

import json
import re

import pytest
import torch
from conftest import tiny_model
from datasets import Dataset
from peft import LoraConfig, PeftModel, get_peft_model

from optimum_pact.dataflow import FrozenLinear
from peft_ext import PACT_CONFIG_NAME, PactConfig
from peft_ext.conversion import apply_pact_options
from peft_ext.options import PactOptions
from peft_ext.precision import probe_precision
from peft_ext.ranking import choose_protected, rank_layers
from trainer_callbacks import PactTrainer, PactTrainingArguments

BLOCKS = 4
BLIND = "model.layers.0.mlp.up_proj"
# not down_proj: an adapter on block 0's down_proj would see BLIND's output through its own input
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj"]


def _blind_spot_model():
    """A model whose worst-quantizing linear cannot move the loss or any gradient.

    BLIND's weights sit half a grid step off NVFP4's values (every 16-block is +-6 then fifteen +-5: 5 lies between 4
    and 6), so its reconstruction error is about twice a Gaussian layer's; block 0's down_proj is zero, so nothing
    downstream sees BLIND's output.
    """
    model = tiny_model("llama", num_hidden_layers=BLOCKS)
    mlp = model.model.layers[0].mlp
    with torch.no_grad():
        w = torch.full_like(mlp.up_proj.weight, 5.0)
        w[:, ::16] = 6.0
        sign = torch.randint(0, 2, w.shape, generator=torch.Generator().manual_seed(0)) * 2 - 1
        mlp.up_proj.weight.copy_(w * sign * 0.02)
        mlp.down_proj.weight.zero_()
    return model


def _batch():
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids}


def _config(**kw):
    return PactConfig(r=4, target_modules=TARGETS, protect_fraction=0.25, **kw)


def test_sensitivity_protects_what_moves_the_gradients_and_error_ranking_does_not():
    model = _blind_spot_model()
    targeted = [(n, e) for n, e in rank_layers(model) if n.rsplit(".", 1)[1] in TARGETS]
    assert targeted[0][0] == BLIND  # the worst reconstruction error of all targeted linears
    assert BLIND in choose_protected(targeted, 0.25)

    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    config = _config(rank_by="sensitivity")
    assert config.needs_calibration
    calibrated = config.with_calibration(model, _batch())
    assert not calibrated.needs_calibration and config.protected_modules is None  # a copy; the original unchanged
    assert calibrated.get_backend() is config.get_backend()
    # the reference path: the probe's own scores, largest first, on the same batch
    scores = {s.name: s.score for s in probe_precision(model, _batch(), config)}
    assert scores[BLIND] == 0.0 and len(scores) == 6 * BLOCKS
    expected = sorted(scores, key=lambda name: (-scores[name], name))[: round(0.25 * len(scores))]
    assert calibrated.protected_modules == expected and BLIND not in expected
    # the probe left the model as it was
    assert {n: p.requires_grad for n, p in model.named_parameters()} == flags and not hasattr(model, "peft_config")

    peft_model = get_peft_model(model, calibrated)
    fp16 = {n for n, m in peft_model.named_modules() if isinstance(m, FrozenLinear) and m.precision == "fp16"}
    assert fp16 == {f"base_model.model.{name}.base_layer" for name in expected}


def test_sensitivity_without_a_calibration_batch_is_a_clear_error():
    with pytest.raises(ValueError, match=r"with_calibration\(model, batch\)"):
        get_peft_model(_blind_spot_model(), _config(rank_by="sensitivity"))
    with pytest.raises(ValueError, match="needs a calibration batch"):
        rank_layers(_blind_spot_model(), "sensitivity")
    with pytest.raises(ValueError, match="rank_by='int4' is not a known ranking"):
        _config(rank_by="int4")
    assert not _config(rank_by="sensitivity", protected_modules=[BLIND]).needs_calibration  # as saved: no probe
    # "auto" without a batch (plain get_peft_model) ranks by NVFP4 error, as rank_by="nvfp4" does
    auto = get_peft_model(_blind_spot_model(), _config())
    assert auto.peft_config["default"].rank_by == "auto"
    assert auto.peft_config["default"].protected_modules == choose_protected(
        [(n, e) for n, e in rank_layers(_blind_spot_model()) if n.rsplit(".", 1)[1] in TARGETS], 0.25
    )


@pytest.mark.parametrize("rank_by", ["sensitivity", "auto"])
def test_trainer_ranks_on_the_first_training_batch_and_the_list_is_saved_and_reused(tmp_path, rank_by):
    ids = torch.randint(0, 128, (8, 16), generator=torch.Generator().manual_seed(0))
    data = Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})
    args = PactTrainingArguments(
        output_dir=str(tmp_path / "run"), report_to="none", use_cpu=True, save_strategy="no", disable_tqdm=True,
        max_steps=8, learning_rate=1e-2, per_device_train_batch_size=4, seed=0, logging_steps=1,
        pact_protect_fraction=0.25, pact_rank_by=rank_by,
    )  # fmt: skip
    model = get_peft_model(_blind_spot_model(), LoraConfig(r=4, target_modules=TARGETS))
    trainer = PactTrainer(model=model, args=args, train_dataset=data)
    config = trainer.model.peft_config["default"]
    first = {"input_ids": ids[:4], "labels": ids[:4]}
    expected = _config(rank_by="sensitivity").with_calibration(_blind_spot_model(), first).protected_modules
    assert config.rank_by == rank_by and config.protected_modules == expected
    trainer.train()
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    assert len(losses) == 8 and losses[-1] < losses[0]
    trainer.model.save_pretrained(tmp_path / "adapter")

    saved = json.loads((tmp_path / "adapter" / PACT_CONFIG_NAME).read_text())
    assert saved["rank_by"] == rank_by and saved["protected_modules"] == expected
    reloaded = PeftModel.from_pretrained(
        _blind_spot_model(), tmp_path / "adapter", config=PactConfig.from_pretrained(tmp_path / "adapter")
    )  # no calibration batch needed: the saved list is reused
    fp16 = {n for n, m in reloaded.named_modules() if isinstance(m, FrozenLinear) and m.precision == "fp16"}
    assert fp16 == {f"base_model.model.{name}.base_layer" for name in expected}
    stock = PeftModel.from_pretrained(_blind_spot_model(), tmp_path / "adapter")  # plain PEFT files
    assert not any(isinstance(m, FrozenLinear) for m in stock.modules())


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"pact_protect_fraction": 0.25, "pact_rank_by": "sensitivity"}, "pact_rank_by='sensitivity'"),
        ({"pact_precision_budget_mib": 1.0}, "pact_precision_budget_mib=1.0"),
    ],
)
def test_calibrating_without_train_data_names_the_option(tmp_path, options, named):
    args = PactTrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True, **options)
    model = get_peft_model(_blind_spot_model(), LoraConfig(r=4, target_modules=TARGETS))
    with pytest.raises(ValueError, match=re.escape(f"{named} needs a train_dataset to calibrate on")):
        PactTrainer(model=model, args=args)


def test_rewrapping_plain_lora_without_a_batch_names_the_option():
    model = get_peft_model(_blind_spot_model(), LoraConfig(r=4, target_modules=TARGETS))
    options = PactOptions(protect_fraction=0.25, rank_by="sensitivity")
    with pytest.raises(ValueError, match=re.escape("pact_rank_by='sensitivity' needs a calibration batch")):
        apply_pact_options(model, options, {"rank_by": "sensitivity"}, prefix="pact_")


def test_a_bare_model_cannot_be_ranked_by_sensitivity(tmp_path):
    args = PactTrainingArguments(
        output_dir=str(tmp_path),
        report_to="none",
        use_cpu=True,
        pact_protect_fraction=0.25,
        pact_rank_by="sensitivity",
    )
    ids = torch.zeros(4, 8, dtype=torch.long).tolist()
    with pytest.raises(ValueError, match="pact_rank_by='sensitivity' needs LoRA adapters"):
        PactTrainer(model=_blind_spot_model(), args=args, train_dataset=Dataset.from_dict({"input_ids": ids}))
