"""PactTrainingArguments / PactTrainer: PACT options as ordinary Trainer fields."""

import pytest
import torch
from conftest import tiny_model
from datasets import Dataset
from peft import get_peft_model
from transformers import HfArgumentParser

from peft_ext import PactConfig
from trainer_callbacks import PactTrainer, PactTrainingArguments


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
    assert logs[-1]["peak_rss_gib"] > 0.05 and logs[-1]["train_steps_per_second_measured"] > 0
