"""The packed base in PACT's cache: built once, read back as the very model quantizing the checkpoint builds."""

import os

import pytest
import torch
from test_generation import PROMPT, _adapter

from optimum_pact.commands import packed_cache
from optimum_pact.commands.modeling import PactModelForCausalLM


@pytest.fixture
def cache(tmp_path, monkeypatch):
    from optimum_pact.commands.default_model import ensure_default_model

    ensure_default_model()  # where it is now, before the cache moves
    monkeypatch.setattr(packed_cache, "cache_dir", lambda *parts: tmp_path.joinpath("cache", *parts))
    return tmp_path / "cache" / "packed"


def _state(pact):
    return {name: tensor.clone() for name, tensor in pact.model.state_dict().items()}


def test_the_cached_base_is_the_built_one_bit_for_bit_and_quantizes_nothing(small_model, cache, tmp_path, monkeypatch):
    adapter = _adapter(small_model, tmp_path / "adapter", seed=1)
    built = PactModelForCausalLM.from_pretrained(str(small_model), adapter=str(adapter), dtype="bfloat16")
    (folder,) = cache.iterdir()  # written by the first load
    with torch.no_grad():
        want = built.model(PROMPT).logits

    def no_quantizing(*args, **kwargs):
        raise AssertionError("the cached base was quantized again")

    monkeypatch.setattr("optimum_pact.quantizer.quantize", no_quantizing)
    again = PactModelForCausalLM.from_pretrained(str(small_model), adapter=str(adapter), dtype="bfloat16")
    assert list(cache.iterdir()) == [folder]
    first, second = _state(built), _state(again)
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)
    with torch.no_grad():
        assert torch.equal(again.model(PROMPT).logits, want)


def test_another_dtype_or_a_changed_base_gets_its_own_folder_and_old_ones_go(small_model, cache, monkeypatch):
    PactModelForCausalLM.from_pretrained(str(small_model), dtype="bfloat16")
    PactModelForCausalLM.from_pretrained(str(small_model), dtype="float32")
    assert len(list(cache.iterdir())) == 2
    weights = small_model / "model.safetensors"
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 1))  # the checkpoint changed
    monkeypatch.setattr(packed_cache, "KEEP", 2)
    PactModelForCausalLM.from_pretrained(str(small_model), dtype="bfloat16")
    folders = list(cache.iterdir())
    assert len(folders) == 2  # the oldest was deleted to keep 2
    assert packed_cache.packed_folder(str(small_model), torch.bfloat16, None) in folders
