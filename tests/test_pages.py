"""Quantizing a mapped checkpoint hands its pages back; pages written since they were mapped are never dropped."""

import pytest
import torch
from conftest import tiny_model
from peft import get_peft_model
from transformers import AutoModelForCausalLM

from optimum_pact import pages
from optimum_pact.dataflow import FrozenLinear
from peft_ext import PactConfig
from peft_ext.blocks import decoder_linears

pytestmark = pytest.mark.skipif(not pages.pages_available(), reason="needs Linux (madvise, /proc/self/pagemap)")


def _mapped_model(tmp_path):
    """A ~30 MB fp32 checkpoint loaded in fp32: transformers maps the file and the parameters are views of it."""
    tiny_model("llama", hidden_size=512, intermediate_size=2048, num_attention_heads=8).save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    weights = {name: linear.weight for name, linear in decoder_linears(model).items()}
    for w in weights.values():
        float(w.detach().sum())  # read: the file's pages become resident in this process
    return model, weights


def _resident(weights):
    return sum(pages.resident_bytes(*pages.byte_range(w)) for w in weights.values())


@pytest.mark.parametrize("release", [True, False])
def test_quantizing_hands_back_the_checkpoint_pages_it_read(tmp_path, monkeypatch, release):
    if not release:
        monkeypatch.setattr("optimum_pact.dataflow.linear.release_clean_pages", lambda t: 0)
    model, weights = _mapped_model(tmp_path)
    total = sum(w.numel() * w.element_size() for w in weights.values())
    flags = pages.page_flags(*pages.byte_range(next(iter(weights.values()))))
    assert bool(((flags & pages.FILE_OR_SHARED) != 0).all()) and _resident(weights) >= total  # mapped file pages
    expected = {name: w.detach().clone() for name, w in weights.items()}

    peft_model = get_peft_model(model, PactConfig(r=4, target_modules="all-linear"))
    assert sum(isinstance(m, FrozenLinear) for m in peft_model.modules()) == len(weights)
    if release:  # a fault maps the page-cache folio around it (2 MiB here), so a neighbour's read can map some back
        assert _resident(weights) < 0.2 * total
    else:
        assert _resident(weights) >= total
    for name, w in weights.items():  # whoever still holds the old weight reads the same values back
        torch.testing.assert_close(w, expected[name], atol=0, rtol=0)


def test_written_pages_are_never_dropped(tmp_path):
    model, weights = _mapped_model(tmp_path)
    name, written = next(iter(weights.items()))
    with torch.no_grad():
        written.mul_(2)  # copy-on-write: these pages are anonymous now and hold the only copy of the new values
    expected = written.detach().clone()
    assert pages.release_clean_pages(written) == 0  # refused: not all clean file pages
    get_peft_model(model, PactConfig(r=4, target_modules="all-linear"))
    torch.testing.assert_close(written, expected, atol=0, rtol=0)
    assert pages.resident_bytes(*pages.byte_range(written)) >= written.numel() * 4 - pages.PAGE
    assert pages.release_clean_pages(torch.ones(1 << 16)) == 0  # anonymous memory: never
