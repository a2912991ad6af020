"""GPTQ rounding into NVFP4: the plain quantizer where inputs are white, a smaller output error where they are not."""

import pytest
import torch

from optimum_pact.nvfp4 import quantize
from optimum_pact.nvfp4.gptq import _inverse_cholesky, gptq_quantize


def _same(a, b) -> bool:
    return (
        torch.equal(a.qdata, b.qdata)
        and torch.equal(a.scale.view(torch.uint8), b.scale.view(torch.uint8))
        and (torch.equal(a.scale_2, b.scale_2))
    )


@pytest.mark.parametrize("k", [64, 160, 320])  # within one lazy block, and across two and three
def test_white_inputs_give_the_nearest_rounding_bit_for_bit(k):
    torch.manual_seed(0)
    w = torch.randn(24, k) * 0.05
    assert _same(gptq_quantize(w, torch.eye(k) * 7.0), quantize(w))


def test_correlated_inputs_get_a_smaller_output_error_than_the_nearest_rounding():
    torch.manual_seed(0)
    k = 256
    mix = torch.randn(k, k) / k**0.5 + torch.eye(k)
    x = torch.randn(2048, k) @ mix  # inputs with correlated features, as a layer's are
    w = torch.randn(64, k) * 0.05
    gptq, nearest = gptq_quantize(w, x.T @ x), quantize(w)

    def output_error(q) -> float:
        return (x @ (w - q.dequantize(torch.float32)).T).pow(2).sum().item()

    assert output_error(gptq) < 0.8 * output_error(nearest), (output_error(gptq), output_error(nearest))


def test_a_hessian_of_another_size_is_refused():
    with pytest.raises(ValueError, match=r"hessian of shape \(32, 32\) for a weight \[8, 64\]"):
        gptq_quantize(torch.randn(8, 64), torch.eye(32))


def test_the_moments_are_taken_over_real_tokens_and_shared_by_layers_reading_one_input(small_model):
    from transformers import AutoModelForCausalLM

    from optimum_pact.commands.calibration import input_hessians

    model = AutoModelForCausalLM.from_pretrained(small_model, dtype=torch.float32)
    modules = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.o_proj", "mlp.up_proj")
    names = [f"model.layers.0.{m}" for m in modules]
    layers = {name: model.get_submodule(name) for name in names}
    rows = [[1, 520, 1742, 314], [5, 61], [7, 8, 9, 10, 11, 12], [300]]
    batched, one_by_one = input_hessians(model, layers, rows, batch_size=3), input_hessians(model, layers, rows, 1)
    for name in names:
        torch.testing.assert_close(batched[name], one_by_one[name], rtol=1e-5, atol=1e-5)
    assert batched[names[0]] is batched[names[1]]  # q and k read the same tensor: one sum
    assert batched[names[0]] is not batched[names[2]] and batched[names[2]] is not batched[names[3]]
    with torch.no_grad():  # layer 0's attention reads the normed embeddings of the 13 real tokens, and nothing else
        x = model.model.layers[0].input_layernorm(model.model.embed_tokens(torch.tensor(sum(rows, []))))
    torch.testing.assert_close(batched[names[0]], x.T @ x, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("k", [96, 301])  # one triangular solve; inverted by halves, unequal ones
def test_the_inverse_factor_is_the_cholesky_factor_of_the_inverse(k):
    x = torch.randn(400, k, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    h = x.T @ x + 0.01 * torch.eye(k, dtype=torch.float64)
    u = _inverse_cholesky(h)
    assert torch.equal(u, u.triu()) and bool((torch.diagonal(u) > 0).all())
    torch.testing.assert_close(u.T @ u, torch.linalg.inv(h), rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(u, torch.linalg.cholesky(torch.linalg.inv(h), upper=True), rtol=1e-9, atol=1e-12)


def test_many_weights_at_once_round_as_each_alone():
    """q, k, v sharing one input's moments are joined by rows, and layers of one shape batched: the codes and scales
    each weight gets alone."""
    from optimum_pact.nvfp4.gptq import gptq_quantize_many

    g = torch.Generator().manual_seed(0)

    def moments(k):
        x = torch.randn(512, k, generator=g) @ (torch.randn(k, k, generator=g) / k**0.5 + torch.eye(k))
        return x.T @ x

    h1, h2, h3 = moments(160), moments(160), moments(64)
    pairs = [(torch.randn(n, k, generator=g) * s, h) for n, k, s, h in
             [(32, 160, 0.05, h1), (16, 160, 0.2, h1), (48, 160, 0.01, h2), (8, 64, 0.1, h3)]]  # fmt: skip
    for (weight, hessian), many in zip(pairs, gptq_quantize_many(pairs)):
        alone = gptq_quantize(weight, hessian)
        assert torch.equal(many.qdata, alone.qdata) and torch.equal(many.scale.float(), alone.scale.float())
        assert torch.equal(many.scale_2, alone.scale_2)
