"""The fused CPU side (optimum_pact.fusion, pact_fuse_cpu_ops): eager's numerics, one compile per shape bucket."""

from __future__ import annotations

import pytest
import torch
from peft import get_peft_model
from torch._dynamo.utils import counters
from transformers import LlamaConfig, LlamaForCausalLM

from optimum_pact import fuse_cpu_ops
from peft_ext import PactConfig


def _model(dtype=torch.bfloat16):
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2,
    )  # fmt: skip
    base = LlamaForCausalLM(config).to(dtype)
    return get_peft_model(base, PactConfig(r=8, lora_alpha=16, target_modules="all-linear", init_lora_weights=False))


def _step(model, ids):
    model.zero_grad()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.requires_grad}
    return loss.float(), grads


def test_the_fused_step_gives_eagers_loss_and_adapter_gradients():
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    eager, fused = _model(), _model()
    handle = fuse_cpu_ops(fused)
    assert handle.modules == 2 * 2 + 1 + 2  # two norms a block and the final one; one gated MLP a block
    loss, grads = _step(eager, ids)
    fused_loss, fused_grads = _step(fused, ids)
    torch.testing.assert_close(fused_loss, loss, atol=0, rtol=2e-2)  # bf16: the fused kernels round differently
    assert grads.keys() == fused_grads.keys() and len(grads) == 2 * 7 * 2
    for name, grad in grads.items():
        scale = grad.abs().max()
        assert scale > 0 and (fused_grads[name] - grad).abs().max() <= 0.05 * scale, name
    handle.restore()
    assert not any("forward" in vars(m) for m in fused.modules())
    torch.testing.assert_close(_step(fused, ids)[0], loss, atol=0, rtol=0)  # eager again: exactly eager's loss


def test_padded_lengths_compile_once_per_bucket_not_every_step():
    torch._dynamo.reset()  # what other tests compiled (shapes seen, dynamic marks) starts over
    model = _model(torch.float32)
    fuse_cpu_ops(model)

    def graphs_after(length):
        ids = torch.randint(0, 256, (2, length), generator=torch.Generator().manual_seed(length))
        _step(model, ids)
        return counters["stats"]["unique_graphs"]

    start = counters["stats"]["unique_graphs"]
    first = graphs_after(16)
    assert graphs_after(16) == first > start  # the same shape: nothing compiled
    second = graphs_after(24)  # another length: compiled once more, with the length symbolic
    assert second > first
    assert [graphs_after(n) for n in (40, 56, 33, 24)] == [second] * 4  # later lengths reuse it


def test_the_trainer_option_fuses_while_training_logs_the_compile_time_and_restores(tmp_path):
    from datasets import Dataset

    from trainer_callbacks import PactTrainer, PactTrainingArguments

    model = _model(torch.float32)
    ids = torch.randint(0, 256, (8, 16), generator=torch.Generator().manual_seed(2)).tolist()
    data = Dataset.from_dict({"input_ids": ids, "labels": ids})
    args = PactTrainingArguments(
        output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=4, logging_steps=2, report_to="none",
        save_strategy="no", pact_fuse_cpu_ops=True, pact_memory_saver="exact", learning_rate=1e-2,
    )  # fmt: skip
    trainer = PactTrainer(model=model, args=args, train_dataset=data)
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == 2 and losses[-1] < losses[0]
    compile_s = [entry["fused_cpu_ops_compile_s"] for entry in trainer.state.log_history if "loss" in entry]
    assert compile_s[0] > 0
    assert trainer.fused_cpu_ops is not None and trainer.fused_cpu_ops.modules == 0  # restored after train()
    assert not any("forward" in vars(m) for m in model.modules())


@pytest.mark.parametrize("value", ["yes", 1])
def test_a_bad_fuse_option_is_named(tmp_path, value):
    from trainer_callbacks import PactTrainingArguments

    with pytest.raises(ValueError, match="pact_fuse_cpu_ops"):
        PactTrainingArguments(output_dir=str(tmp_path), pact_fuse_cpu_ops=value)
