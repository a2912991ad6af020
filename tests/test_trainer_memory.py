"""PactTrainer with pact_memory_saver: savers on for train() only, no gradient changed ('exact'), nothing left."""

import errno
import os

import pytest
import torch
from conftest import tiny_model
from datasets import Dataset
from peft import get_peft_model

import optimum_pact.memory.offload as offload_module
from optimum_pact.memory import OffloadError
from peft_ext import PactConfig
from trainer_callbacks import PactTrainer, PactTrainingArguments


def _args(tmp_path, **kw):
    return PactTrainingArguments(
        output_dir=str(tmp_path), report_to="none", use_cpu=True, save_strategy="no", disable_tqdm=True,
        per_device_train_batch_size=4, learning_rate=1e-2, logging_steps=1, **kw,
    )  # fmt: skip


def _data():
    torch.manual_seed(0)
    ids = torch.randint(0, 128, (8, 24))
    labels = ids.clone()
    labels[:, :10] = -100  # a prompt: no loss there (logits masking skips those positions)
    return Dataset.from_dict({"input_ids": ids.tolist(), "labels": labels.tolist()})


def _train(tmp_path, **kw):
    model = get_peft_model(tiny_model(), PactConfig(r=4, target_modules="all-linear", lora_dropout=0.0))
    trainer = PactTrainer(model=model, args=_args(tmp_path, **kw), train_dataset=_data())
    trainer.train()
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    adapters = {k: v.detach().clone() for k, v in model.named_parameters() if v.requires_grad}
    return losses, adapters, model


def _patched_forwards(model) -> list[str]:
    return [name for name, m in model.named_modules() if "forward" in vars(m)]


def test_exact_savers_train_like_plain_training_and_leave_nothing(tmp_path):
    plain_losses, plain, _ = _train(tmp_path / "plain", max_steps=4)
    losses, adapters, model = _train(tmp_path / "exact", max_steps=4, pact_memory_saver="exact")
    assert len(losses) == 4
    # same loss and gradients up to float summation order (block recomputation, chunked cross-entropy)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(plain_losses), atol=1e-4, rtol=1e-4)
    for name, value in plain.items():
        torch.testing.assert_close(adapters[name], value, atol=1e-4, rtol=1e-3, msg=name)
    assert not any((tmp_path / "exact" / "pact-offload").iterdir())  # the private offload folder is gone
    assert _patched_forwards(model) == []  # forwards restored: the model is back to normal after train()
    assert model(input_ids=torch.zeros(1, 4, dtype=torch.long)).logits.shape == (1, 4, 128)


def test_the_logits_saver_trains_exactly_as_plain_training_without_prompt_logits(tmp_path, monkeypatch):
    import optimum_pact.memory.logits_mask as logits_mask

    heads = []  # rows the output head ran on in each training forward
    real = logits_mask.subset_cross_entropy
    monkeypatch.setattr(
        logits_mask,
        "subset_cross_entropy",
        lambda hidden, *a, **k: heads.append(hidden.shape[0]) or real(hidden, *a, **k),
    )
    plain_losses, plain, _ = _train(tmp_path / "plain", max_steps=4)
    losses, adapters, model = _train(tmp_path / "logits", max_steps=4, pact_memory_saver="logits")
    # the head ran on the labelled positions only: 4 rows x (24 - 10) shifted targets, not 4 x 23 positions
    assert heads == [4 * 14] * 4
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(plain_losses), atol=1e-5, rtol=1e-5)
    for name, value in plain.items():
        torch.testing.assert_close(adapters[name], value, atol=1e-5, rtol=1e-4, msg=name)
    assert _patched_forwards(model) == [] and not (tmp_path / "logits" / "pact-offload").exists()


def test_full_savers_train_with_the_subset_softmax(tmp_path):
    losses, _, _ = _train(tmp_path, max_steps=24, pact_memory_saver="full", pact_subset_k=16)
    assert losses[-1] < losses[0] - 0.4


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"pact_memory_saver": "all"}, "pact_memory_saver='all' is not one of none, logits, exact, full"),
        ({"pact_memory_saver": "exact", "activation_checkpointing": True}, "set activation_checkpointing=False"),
        ({"pact_memory_saver": "exact", "pact_subset_k": 100}, "pact_subset_k=100 is used by pact_memory_saver="),
        ({"pact_memory_saver": "full", "pact_subset_k": 0}, "pact_subset_k=0 must be a positive integer"),
        ({"pact_memory_saver": "full", "pact_activation_cache_mib": -1}, "pact_activation_cache_mib=-1 must be"),
        ({"pact_memory_saver": "full", "pact_mlp_chunk_tokens": 0}, "pact_mlp_chunk_tokens=0 must be"),
    ],
)
def test_bad_memory_saver_option_is_a_clear_error(tmp_path, options, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        _args(tmp_path, **options)


def test_subset_k_larger_than_the_vocabulary_fails_before_training(tmp_path):
    model = get_peft_model(tiny_model(), PactConfig(r=4, target_modules="all-linear"))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    args = _args(tmp_path, max_steps=1, pact_memory_saver="full", pact_subset_k=129)
    trainer = PactTrainer(model=model, args=args, train_dataset=_data())
    with pytest.raises(ValueError, match=r"pact_subset_k=129 is larger than the vocabulary \(128 tokens\)"):
        trainer.train()
    assert trainer.state.global_step == 0 and _patched_forwards(model) == []
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


def test_unwritable_offload_dir_is_a_clear_error(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    model = get_peft_model(tiny_model(), PactConfig(r=4, target_modules="all-linear"))
    args = _args(tmp_path, max_steps=1, pact_memory_saver="exact", pact_offload_dir=str(blocker / "offload"))
    with pytest.raises(OffloadError, match="pact_offload_dir=.*is not writable"):
        PactTrainer(model=model, args=args, train_dataset=_data()).train()
    assert _patched_forwards(model) == []


def test_out_of_space_mid_training_stops_cleanly(tmp_path, monkeypatch):
    model = get_peft_model(tiny_model(), PactConfig(r=4, target_modules="all-linear"))
    real_write, writes = offload_module._write_bytes, []

    def fills_up(path, data):  # the disk fills up during the third step (2 blocks: 2 writes a step)
        writes.append(path)
        if len(writes) == 5:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_write(path, data)

    monkeypatch.setattr(offload_module, "_write_bytes", fills_up)
    trainer = PactTrainer(model=model, args=_args(tmp_path, max_steps=5, pact_memory_saver="exact"),
                          train_dataset=_data())  # fmt: skip
    with pytest.raises(OffloadError, match="ran out of space"):
        trainer.train()
    assert trainer.state.global_step == 2  # the two good steps stand; the failed one changed nothing
    assert not any((tmp_path / "pact-offload").iterdir()) and _patched_forwards(model) == []
