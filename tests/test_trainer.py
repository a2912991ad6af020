"""PactTrainingArguments / PactTrainer: PACT options as ordinary Trainer fields."""

import pytest
import torch
from conftest import tiny_model
from datasets import Dataset
from peft import get_peft_model
from transformers import HfArgumentParser

from peft_ext import PactConfig
from trainer_callbacks import PactTrainer, PactTrainingArguments
from trainer_callbacks.resources import peak_rss_bytes


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def _args(tmp_path, **kw):
    return PactTrainingArguments(
        output_dir=str(tmp_path), report_to="none", use_cpu=True, save_strategy="no", disable_tqdm=True, **kw
    )


def test_pact_options_parse_like_any_training_argument(tmp_path):
    (args,) = HfArgumentParser(PactTrainingArguments).parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--pact_num_threads", "1", "--report_to", "none"]
    )
    assert args.pact_num_threads == 1 and args.pact_report_resources is True


@pytest.mark.parametrize("value", [0, -2, 1.5, True])
def test_bad_thread_count_is_a_clear_error(tmp_path, value):
    with pytest.raises(ValueError, match=f"pact_num_threads={value!r} must be a positive integer"):
        _args(tmp_path, pact_num_threads=value)


def test_trainer_trains_pact_model_and_reports_resources(tmp_path):
    torch.manual_seed(0)
    ids = torch.randint(0, 128, (8, 16))
    data = Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})
    model = get_peft_model(tiny_model(), PactConfig(r=4, target_modules="all-linear"))
    threads = torch.get_num_threads()
    rss_before = _rss_bytes()
    trainer = PactTrainer(
        model=model,
        args=_args(tmp_path, max_steps=25, learning_rate=1e-2, logging_steps=5, per_device_train_batch_size=8,
                   pact_num_threads=1),
        train_dataset=data,
    )  # fmt: skip
    try:
        trainer.train()
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)
    logs = [log for log in trainer.state.log_history if "loss" in log]
    assert logs[-1]["loss"] < logs[0]["loss"] - 0.5
    # the reported peak is this process's VmHWM: at least the resident set before training, at most the peak now
    peak = logs[-1]["peak_rss_gib"]  # rounded to 3 decimals
    assert rss_before / 2**30 - 0.0005 <= peak <= peak_rss_bytes() / 2**30 + 0.0005
    # the measured throughput is steps over the wall-clock of training (the Trainer's own figure counts the same)
    final = trainer.state.log_history[-1]
    assert logs[-1]["train_steps_per_second_measured"] == pytest.approx(final["train_steps_per_second"], rel=0.5)


def test_total_flos_is_the_trainers_with_the_parameters_counted_once_per_train(tmp_path, monkeypatch):
    from transformers import Trainer

    torch.manual_seed(0)
    ids = torch.randint(0, 128, (8, 16))
    data = Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})
    model = get_peft_model(tiny_model(), PactConfig(r=4, target_modules="all-linear"))
    args = _args(tmp_path, max_steps=3, per_device_train_batch_size=4)
    trainer = PactTrainer(model=model, args=args, train_dataset=data)
    counted = []
    count = type(model.base_model.model).num_parameters
    monkeypatch.setattr(
        type(model.base_model.model), "num_parameters", lambda m, **kw: counted.append(1) or count(m, **kw)
    )
    trainer.train()
    assert len(counted) == 1  # transformers' own count would walk the model on each of the 3 steps
    expected = 3 * Trainer.floating_point_ops(trainer, {"input_ids": ids[:4]})
    assert trainer.state.total_flos == expected and expected > 0
