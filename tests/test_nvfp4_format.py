"""NVFP4 numerics at three levels: exact bit tables, exact equality with torchao (the "6" scale rule), SQNR; and what
the "4/6" and "mse" scale rules choose."""

import pytest
import torch

from optimum_pact.nvfp4 import (
    BLOCK_SIZE,
    E2M1_VALUES,
    SCALE_RULES,
    dequantize_reference,
    fake_quantize,
    float_to_e2m1,
    pack_e2m1,
    quantize,
    tensor_scale,
    unpack_e2m1,
)
from optimum_pact.nvfp4.format import _block_error, _e2m1_round, _reconstructed, _scaled, e2m1_table


@pytest.fixture
def torchao_quantize():
    """torchao's NVFP4 quantizer (the `test` extra), as (qdata, scale, scale_2); skips the test without torchao."""
    nvfp4 = pytest.importorskip("torchao.prototype.mx_formats.nvfp4_tensor")

    def run(weight):
        scale_2 = nvfp4.per_tensor_amax_to_scale(weight.abs().max())
        scale, qdata = nvfp4.nvfp4_quantize(weight, 16, scale_2)
        return qdata, scale, scale_2

    return run


@pytest.mark.parametrize(
    "value, code",
    [
        (0.0, 0), (0.25, 0), (0.2500001, 1), (0.5, 1), (0.75, 2), (1.0, 2), (1.25, 2), (1.2500001, 3),
        (1.5, 3), (1.75, 4), (2.0, 4), (2.5, 4), (2.5000002, 5), (3.0, 5), (3.5, 6), (4.0, 6), (5.0, 6),
        (5.0000005, 7), (6.0, 7), (-0.0, 8), (-0.1, 8), (-0.25, 8), (-0.75, 10), (-1.75, 12), (-5.0, 14), (-6.0, 15),
    ],
)  # fmt: skip
def test_e2m1_rounding_ties_to_even(value, code):
    assert float_to_e2m1(torch.tensor([value])).item() == code


def test_e2m1_table_round_trips():
    values = torch.tensor(E2M1_VALUES)
    assert float_to_e2m1(values).tolist() == list(range(16))


def test_pack_low_nibble_first():
    codes = torch.tensor([[1, 2, 3, 4, 15, 0]], dtype=torch.uint8)
    packed = pack_e2m1(codes)
    assert packed.tolist() == [[0x21, 0x43, 0x0F]]
    assert torch.equal(unpack_e2m1(packed), codes)


@pytest.mark.parametrize("shape", [(32, 64), (96, 576), (7, 1536)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_matches_torchao_bit_for_bit(torchao_quantize, shape, dtype):
    torch.manual_seed(sum(shape))
    weight = (torch.randn(shape) * torch.rand(shape[0], 1) * 4).to(dtype)
    q = quantize(weight, scale_rule="6")
    qdata, scale, scale_2 = torchao_quantize(weight)
    assert torch.equal(q.qdata, qdata)
    assert torch.equal(q.scale.view(torch.uint8), scale.view(torch.uint8))
    assert torch.equal(q.scale_2, scale_2.float())
    # torchao dequantizes as (E2M1 * scale) * scale_2; ours must be the same values exactly
    expected = (torch.tensor(E2M1_VALUES)[unpack_e2m1(qdata).long()].reshape(shape[0], -1, 16)
                * scale.float().unsqueeze(-1) * scale_2).reshape(shape)  # fmt: skip
    assert torch.equal(q.dequantize(torch.float32), expected)


def test_layout_and_dtypes():
    q = quantize(torch.randn(48, 64))
    assert q.qdata.dtype == torch.uint8 and q.qdata.shape == (48, 32)
    assert q.scale.dtype == torch.float8_e4m3fn and q.scale.shape == (48, 4)
    assert q.scale_2.dtype == torch.float32 and q.scale_2.shape == ()
    assert q.shape == (48, 64)
    assert q.nbytes == 48 * 32 + 48 * 4 + 4


def test_all_zero_blocks_and_all_zero_weight():
    w = torch.randn(4, 64)
    w[1] = 0
    w[2, 16:32] = 0
    q = quantize(w)
    deq = q.dequantize()
    assert torch.equal(deq[1], torch.zeros(64)) and torch.equal(deq[2, 16:32], torch.zeros(16))
    assert torch.equal(quantize(torch.zeros(16, 32)).dequantize(), torch.zeros(16, 32))


def test_block_with_one_huge_outlier():
    torch.manual_seed(0)
    w = torch.randn(8, 64) * 1e-2
    w[3, 5] = 1e4
    q = quantize(w)
    deq = q.dequantize()
    assert deq[3, 5].item() == pytest.approx(1e4, rel=1e-6)  # the outlier itself is exact up to fp32 rounding
    assert torch.isfinite(deq).all()
    others = torch.ones_like(w, dtype=torch.bool)
    others[3] = False
    # tiny blocks get the smallest normal e4m3 scale: still finite, and error bounded by that scale
    assert (deq[others] - w[others]).abs().max() <= 6 * 2**-6 * q.scale_2


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_input_is_a_clear_error(bad):
    w = torch.randn(4, 32)
    w[1, 3] = bad
    with pytest.raises(ValueError, match="NaN or inf"):
        quantize(w)


def test_in_features_not_multiple_of_16_is_a_clear_error():
    with pytest.raises(ValueError, match="multiple of 16.*exclude it from target_modules"):
        quantize(torch.randn(4, 40))


def test_sqnr_gaussian_weight():
    torch.manual_seed(0)
    w = torch.randn(256, 512)
    deq = dequantize_reference(*(lambda q: (q.qdata, q.scale, q.scale_2))(quantize(w)))
    sqnr = 10 * torch.log10(w.pow(2).sum() / (w - deq).pow(2).sum()).item()
    assert sqnr > 19.5, f"NVFP4 SQNR {sqnr:.2f} dB for a 256x512 N(0,1) weight; expected > 19.5 dB"


def test_block_with_one_huge_outlier_matches_torchao(torchao_quantize):
    torch.manual_seed(0)
    w = torch.randn(8, 64) * 1e-2
    w[3, 5] = 1e4
    q = quantize(w, scale_rule="6")
    qdata, scale, _ = torchao_quantize(w)
    assert torch.equal(q.qdata, qdata) and torch.equal(q.scale.view(torch.uint8), scale.view(torch.uint8))


def _weight(shape, dtype):
    w = torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 0.02
    w[0, :3] = 0.0  # exact zeros
    w[-1, -1] = 0.5  # an outlier
    return w.to(dtype)


@pytest.mark.parametrize("scale_rule", SCALE_RULES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(64, 128), (96, 208), (7, 48), (33, 16)])
def test_fake_quantize_is_bit_exact_with_the_reference(shape, dtype, scale_rule):
    w = _weight(shape, dtype)
    q = quantize(w, scale_rule)
    expected = dequantize_reference(q.qdata, q.scale, q.scale_2)
    assert torch.equal(fake_quantize(w, scale_rule=scale_rule), expected)
    assert torch.equal(tensor_scale(w), q.scale_2)
    # slices of rows with the whole weight's scale_2 (the amax sits in the last row) give the same rows
    whole = tensor_scale(w)
    rows = [fake_quantize(w[start : start + 5], whole, scale_rule) for start in range(0, shape[0], 5)]
    assert torch.equal(torch.cat(rows), expected)
    assert torch.equal(fake_quantize(torch.zeros(4, 32)), torch.zeros(4, 32))
    with pytest.raises(ValueError, match="multiple of 16"):
        fake_quantize(torch.randn(4, 24))


def test_fast_e2m1_rounding_is_exact_at_every_tie():
    # every multiple of 1/64 in [-6, 6] (all ties included), its float neighbours, and -0.0
    grid = torch.arange(-384, 385, dtype=torch.float32) / 64
    up, down = torch.tensor(8.0), torch.tensor(-8.0)
    y = torch.cat([grid, torch.nextafter(grid, up), torch.nextafter(grid, down), torch.tensor([-0.0])]).clamp(-6, 6)
    expected = e2m1_table()[float_to_e2m1(y).long()]
    got = _e2m1_round(y)
    assert torch.equal(got, expected) and torch.equal(got.signbit(), expected.signbit())


def test_four_over_six_maps_a_block_of_near_maximal_values_to_4():
    # amax 21, so scale_2 = 21 / 2688 = 2**-7 and the first block's candidates are exact e4m3 scales: 128 (6) and 192
    # (4). Under "6" its fives tie between 4 and 6 and go to 4 (even code), one unit off each; mapped to 4 they become
    # 3.33 -> 3 -> 4.5, half a unit off, and 6 stays exact. The second block holds the amax: its 4-candidate (672)
    # stops at e4m3's 448, the 6-candidate's scale, so it stays at 6.
    w = torch.tensor([[5.0] * 15 + [6.0], [0.0] * 15 + [21.0]])
    assert fake_quantize(w, scale_rule="6").tolist() == [[4.0] * 15 + [6.0], [0.0] * 15 + [21.0]]
    assert fake_quantize(w, scale_rule="4/6").tolist() == [[4.5] * 15 + [6.0], [0.0] * 15 + [21.0]]
    q = quantize(w, scale_rule="4/6")
    assert q.scale.float().tolist() == [[192.0], [448.0]] and q.scale_2.item() == 2**-7
    # a block on E2M1's own grid (times 448 * scale_2, scale_2 = 2**-12) is exact under 6, and a tie keeps 6
    exact = torch.tensor([[0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0] * 2]) * (448 * 2**-12)
    for rule in ("4/6", "mse"):
        assert torch.equal(fake_quantize(exact, scale_rule=rule), exact)
        assert quantize(exact, rule).scale.float().tolist() == [[448.0]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_four_over_six_takes_the_better_of_the_two_scales_in_every_block(dtype):
    torch.manual_seed(0)
    w = (torch.randn(64, 256) * torch.rand(64, 1) * 3).to(dtype)
    w[5, 7] = 40.0  # an outlier: its block's 4-candidate scale (672) stops at 448, the 6-candidate's
    scale_2 = tensor_scale(w)  # the same under both rules: amax / (6 * 448)

    def block_error(recon):
        return (recon - w.float()).reshape(64, -1, BLOCK_SIZE).square().sum(-1)

    six = block_error(fake_quantize(w, scale_2, "6"))
    chosen = block_error(fake_quantize(w, scale_2, "4/6"))
    block_amax = w.float().reshape(64, -1, BLOCK_SIZE).abs().amax(-1)
    four_scale = (block_amax / 4 / scale_2).clamp(max=448).to(torch.float8_e4m3fn).float()
    scale = quantize(w, "4/6").scale.float()
    took_four = scale != (block_amax / 6 / scale_2).to(torch.float8_e4m3fn).float()
    assert torch.equal(scale[took_four], four_scale[took_four])  # each block took one of the two candidates
    assert torch.equal(chosen[~took_four], six[~took_four])
    assert (chosen[took_four] < six[took_four]).all()  # ... 4 only where it is strictly better
    assert 0.2 < took_four.float().mean() < 0.8  # both happen on a Gaussian weight
    sqnr = lambda err: 10 * torch.log10(w.float().square().sum() / err.sum()).item()  # noqa: E731
    assert sqnr(chosen) > sqnr(six) + 0.5, (sqnr(chosen), sqnr(six))


@pytest.mark.parametrize("call", [quantize, fake_quantize])
def test_unknown_scale_rule_is_a_clear_error(call):
    message = r"scale_rule='8' is not an NVFP4 scale rule; choose one of 'mse', '4/6', '6'"
    with pytest.raises(ValueError, match=message):
        call(torch.randn(4, 32), scale_rule="8")


@pytest.mark.parametrize("distribution", ["gaussian", "student-t"])
def test_mse_rule_finds_the_best_e4m3_block_scale(distribution):
    torch.manual_seed(0)
    if distribution == "gaussian":
        w = torch.randn(64, 256) * torch.rand(64, 1) * 3
    else:  # heavy tails: a few large elements per block, as in real weights
        w = torch.distributions.StudentT(2.0).sample((64, 256))
    scale_2 = tensor_scale(w)
    blocks = w.reshape(64, -1, BLOCK_SIZE)

    def block_error(recon):
        return (recon - w).reshape(64, -1, BLOCK_SIZE).square().sum(-1)

    # the oracle: every e4m3 scale the quantizer may store (codes 8 = 2**-6 to 126 = 448), each block's best
    errors = []
    for code in range(8, 127):
        scale = torch.tensor(code, dtype=torch.uint8).view(torch.float8_e4m3fn).float().expand(64, 16)
        errors.append((_reconstructed(_scaled(blocks, scale, scale_2), scale, scale_2) - blocks).square().sum(-1))
        assert torch.equal(_block_error(blocks.abs(), scale, scale_2), errors[-1])  # the search's fast error
    best = torch.stack(errors).min(dim=0).values
    mse, four_six = block_error(fake_quantize(w, scale_2, "mse")), block_error(fake_quantize(w, scale_2, "4/6"))
    assert (mse <= four_six).all()  # its candidates include 4/6's two
    hit = (mse == best).float().mean().item()
    assert hit > 0.98, f"{distribution}: the best scale in only {hit:.1%} of blocks"
    assert mse.sum() / best.sum() < 1.002, (distribution, (mse.sum() / best.sum()).item())
    assert four_six.sum() / mse.sum() > 1.03  # and it is worth having: 4/6 leaves error a search removes


@pytest.mark.parametrize("scale_rule", SCALE_RULES)
@pytest.mark.parametrize("distribution", ["gaussian", "student-t", "on a coarse grid"])
def test_quantizing_a_reconstruction_again_changes_nothing(scale_rule, distribution):
    # what a merge into a dequantized NVFP4 model or a re-quantized export relies on
    torch.manual_seed(0)
    w = {
        "gaussian": torch.randn(256, 512) * torch.rand(256, 1),
        "student-t": torch.distributions.StudentT(2.0).sample((256, 512)),
        "on a coarse grid": torch.randint(-7, 8, (256, 512)).float() * 0.01,
    }[distribution]
    # the amax's block, with fifteen at 11/12 of it: a scale one code below 448 would serve the fifteen better (they
    # tie between 4 and 6 at 448) by clipping the amax, which "mse" must not do, or scale_2 would move
    w[0, 0] = 2 * w.abs().max()
    w[0, 1:16] = w[0, 0] * 11 / 12
    once = fake_quantize(w, scale_rule=scale_rule)
    assert torch.equal(fake_quantize(once, scale_rule=scale_rule), once)
    assert torch.equal(tensor_scale(once), tensor_scale(w))
