"""pact_sdpa (optimum_pact.attention): sdpa's results from fp32 matmuls at short lengths while training on the CPU."""

import contextlib

import pytest
import torch
from conftest import tiny_model
from datasets import Dataset
from peft import get_peft_model
from transformers import TrainerCallback

import optimum_pact.attention as attention
from peft_ext import PactConfig
from trainer_callbacks import PactTrainer, PactTrainingArguments

TOL = {"atol": 2e-6, "rtol": 1e-5}  # fp32: the same products summed in another order


@pytest.fixture
def calls(monkeypatch):
    """How many layer calls went to transformers' sdpa function (the rest ran pact_sdpa's matmuls)."""
    seen = []
    sdpa = attention.sdpa_attention_forward

    def counted(*args, **kwargs):
        seen.append(args[1].shape)
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(attention, "sdpa_attention_forward", counted)
    return seen


def _batch(padding: str | None) -> dict:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 128, (3, 9), generator=g)
    mask = torch.ones_like(ids)
    if padding == "right":
        mask[0, 6:], mask[2, 4:] = 0, 0
    elif padding == "left":
        mask[0, :3], mask[2, :5] = 0, 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def _loss_and_grads(model, batch: dict, implementation: str):
    model.set_attn_implementation(implementation)
    model.zero_grad()
    out = model(**batch)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.loss.detach(), out.logits.detach(), grads


@pytest.mark.parametrize("padding", [None, "right", "left"])
def test_training_step_equals_sdpas(arch, padding, calls):
    # 4 query heads on 2 key/value heads: the grouped product; None: no mask, causal by position
    model = tiny_model(arch)
    batch = _batch(padding)
    loss, logits, grads = _loss_and_grads(model, batch, "sdpa")
    assert calls == []  # model.forward called transformers' sdpa directly, not through us
    short_loss, short_logits, short_grads = _loss_and_grads(model, batch, attention.NAME)
    assert calls == []  # both layers ran the matmul path
    real = batch["attention_mask"].bool()
    torch.testing.assert_close(short_logits[real], logits[real], **TOL)
    torch.testing.assert_close(short_loss, loss, **TOL)
    assert set(short_grads) == set(grads) and len(grads) > 10
    for name, grad in grads.items():
        torch.testing.assert_close(short_grads[name], grad, **TOL, msg=lambda m, name=name: f"{name}: {m}")


def test_inference_long_rows_and_unsupported_features_go_to_sdpa(monkeypatch, calls):
    model = tiny_model("llama", attn_implementation=attention.NAME)
    batch = _batch("right")
    with torch.no_grad():  # inference: sdpa's kernels, unchanged
        model(**batch)
    assert len(calls) == 2
    monkeypatch.setattr(attention, "EAGER_MAX_SCORES", 3 * 4 * 9 * 9 - 1)  # one score more than allowed
    model(**batch).loss.backward()
    assert len(calls) == 4
    monkeypatch.setattr(attention, "EAGER_MAX_SCORES", 3 * 4 * 9 * 9)
    model(**batch).loss.backward()
    assert len(calls) == 4
    monkeypatch.setattr(attention, "EAGER_MAX_LENGTH", 8)  # one key more than allowed
    model(**batch).loss.backward()
    assert len(calls) == 6
    monkeypatch.setattr(attention, "EAGER_MAX_LENGTH", 9)
    q = torch.randn(1, 4, 5, 16, requires_grad=True)
    for extra in ({"softcap": 30.0}, {"s_aux": torch.zeros(4)}, {"output_attentions": True}):
        with pytest.raises(ValueError, match="softcap") if "softcap" in extra else contextlib.nullcontext():
            attention.short_attention_forward(model.model.layers[0].self_attn, q, q[:, :2], q[:, :2], None, **extra)
    assert len(calls) == 9


class _SeenImplementation(TrainerCallback):
    def __init__(self):
        self.seen = []

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        self.seen.append(model.config._attn_implementation)


def _trainer(tmp_path, model, **options) -> tuple[PactTrainer, _SeenImplementation]:
    args = PactTrainingArguments(
        output_dir=str(tmp_path), report_to="none", use_cpu=True, save_strategy="no", disable_tqdm=True,
        pact_report_resources=False, max_steps=2, per_device_train_batch_size=3, **options,
    )  # fmt: skip
    rows = Dataset.from_list([{k: v[i].tolist() for k, v in _batch(None).items()} for i in range(3)])
    seen = _SeenImplementation()
    return PactTrainer(model=model, args=args, train_dataset=rows, callbacks=[seen]), seen


@pytest.mark.parametrize(("loaded", "option", "trained"), [
    ("sdpa", True, attention.NAME), ("sdpa", False, "sdpa"), ("eager", True, "eager"),
])  # fmt: skip
def test_pact_trainer_trains_on_pact_sdpa_and_gives_the_model_back(tmp_path, loaded, option, trained):
    model = get_peft_model(tiny_model("llama", attn_implementation=loaded), PactConfig(r=4))
    trainer, seen = _trainer(tmp_path, model, pact_short_attention=option)
    trainer.train()
    assert seen.seen == [trained, trained]
    assert model.config._attn_implementation == loaded  # evaluation and generation run what was loaded


def test_bad_option_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="pact_short_attention='yes' must be True or False"):
        PactTrainingArguments(output_dir=str(tmp_path), pact_short_attention="yes")
