"""`pact finetune`'s base without a full-precision copy (`streamed_base.py`): AQLoRA's list ranked from the checkpoint
one weight at a time, the base loaded through PACT's quantizer. It must be exactly the model `get_peft_model` builds
from the loaded 16-bit base: the same protected linears, the same adapter start, the same logits."""

import json

import pytest
import torch
from peft import get_peft_model
from transformers import AutoModelForCausalLM

from optimum_pact.commands import streamed_base
from optimum_pact.commands.streamed_base import load_streamed_base, protected_from_checkpoint, streams
from optimum_pact.dataflow import FrozenLinear
from peft_ext import PactConfig


def _config(**options) -> PactConfig:
    options = {"target_modules": "all-linear", "protect_fraction": 0.25, "rank_by": "nvfp4", **options}
    return PactConfig(r=4, lora_alpha=8, **options)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_streamed_base_is_the_model_get_peft_model_builds(small_model, dtype, tmp_path, monkeypatch):
    monkeypatch.setenv("PACT_CACHE", str(tmp_path))  # the packed base is written here, then read back
    ids = torch.randint(0, 1000, (2, 12), generator=torch.Generator().manual_seed(0))
    reference_config = _config()
    torch.manual_seed(0)
    reference = get_peft_model(AutoModelForCausalLM.from_pretrained(small_model, dtype=dtype), reference_config)
    for _ in range(2):  # quantized while loading, then read from the packed cache
        base, config = load_streamed_base(_config(), str(small_model), None, dtype)
        torch.manual_seed(0)
        model = get_peft_model(base, config)
        assert config.protected_modules == reference_config.protected_modules and len(config.protected_modules) == 4
        expected = reference.state_dict()
        got = model.state_dict()
        assert set(got) == set(expected)
        assert [k for k in expected if not torch.equal(got[k], expected[k])] == []  # packed codes, scales, adapters
        with torch.no_grad():
            assert torch.equal(model(ids).logits, reference(ids).logits)
        frozen = [m for m in model.modules() if isinstance(m, FrozenLinear)]
        assert len(frozen) == 14 and all(m.backend is config.get_backend() for m in frozen)
        assert config.base_dtype == str(dtype).removeprefix("torch.")
        assert model.peft_config["default"].base_model_name_or_path == str(small_model)  # not the packed cache
        assert len(list((tmp_path / "packed").iterdir())) == 1  # written by the first load, read by the second


def test_what_needs_the_unquantized_model_loads_it_as_before(small_model):
    assert streams(_config(), str(small_model))
    assert not streams(_config(rank_by="sensitivity"), str(small_model))  # a gradient probe on the 16-bit model
    assert not streams(_config(precision_budget_mib=1.0), str(small_model))
    assert not streams(_config(adapt="speed"), str(small_model))
    assert not streams(_config(), "HuggingFaceTB/SmolLM2-135M-Instruct")  # no local checkpoint to read


def test_the_ranking_is_computed_once_per_checkpoint_and_read_back_exactly(small_model, tmp_path, monkeypatch):
    monkeypatch.setenv("PACT_CACHE", str(tmp_path))
    _, protected = protected_from_checkpoint(_config(), str(small_model), torch.bfloat16)
    (cached,) = (tmp_path / "ranking").iterdir()
    errors = dict(json.loads(cached.read_text()))
    assert len(errors) == 14 and sorted(errors, key=lambda n: (-errors[n], n))[:4] == protected
    calls = []
    monkeypatch.setattr(streamed_base, "reconstruction_error", lambda *a: calls.append(a) or 0.0)
    assert protected_from_checkpoint(_config(), str(small_model), torch.bfloat16)[1] == protected  # read back
    assert calls == []
    half = protected_from_checkpoint(_config(protect_fraction=0.5), str(small_model), torch.bfloat16)[1]
    assert half[:4] == protected and len(half) == 7
    assert calls == []  # another fraction of the same errors
    protected_from_checkpoint(_config(), str(small_model), torch.float32)
    assert len(calls) == 14  # another dtype: its own errors
    cached.write_text("not json")  # damaged: ranked again
    calls.clear()
    assert protected_from_checkpoint(_config(), str(small_model), torch.bfloat16)[1] == sorted(errors)[:4]  # ties
    assert len(calls) == 14
