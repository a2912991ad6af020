"""AQLoRA's ranking: which decoder linears to keep 16-bit, by 4-bit reconstruction error or by gradient sensitivity.

The error rankings ("nf4", "nvfp4") take one CPU pass computing ||W - deq(q(W))||_F / ||W||_F per decoder linear, for
NF4 (bitsandbytes' codebook, 64-element blocks, fp32 absmax, no double quant) or NVFP4 (PACT's base format): no data,
no search, the list depends on the weights alone and ties are broken by name. "sensitivity" ranks by the precision
probe's score (how much the layer's NVFP4 weight moves all adapter gradients, `optimum_pact.precision`), which needs
a calibration batch: `PactConfig.with_calibration(model, batch)` measures it (PactTrainer and `pact finetune` take
the first training batch).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from optimum_pact.errors import OptionError
from optimum_pact.nvfp4 import BLOCK_SIZE, fake_quantize, tensor_scale

from .blocks import decoder_linears

ERROR_FORMATS = ("nf4", "nvfp4")  # rankings by reconstruction error: the weights alone
RANK_BY = ("auto", *ERROR_FORMATS, "sensitivity")
CALIBRATED = ("auto", "sensitivity")  # rankings that use a calibration batch ("auto": when one is at hand)
NF4_BLOCK_SIZE = 64  # bitsandbytes' default blocksize for quantize_4bit / Linear4bit
# bitsandbytes' NF4 codebook (QLoRA paper, Appendix E), in code order; codes are sorted ascending.
NF4_VALUES = (
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
)
CHUNK_ELEMENTS = 1 << 18  # elements per chunk: every temporary (~1 MB) stays in L2, memory stays flat


class _NF4Table:
    """Exact NF4 rounding without a binary search: a uniform table over [-1, 1] whose bins hold at most one midpoint.

    bitsandbytes rounds `x / absmax` to the code with `bucketize(x, midpoints)` (a tie goes to the lower code). With
    4096 bins every midpoint lies > 2e-5 from a bin edge (checked here), so the bin `x` falls in, even one float
    rounding off, tells the two candidate codes, and one comparison with that bin's midpoint picks the right one.
    1.8x faster than `torch.bucketize` on CPU; bit-exact (tests/test_protection.py).
    """

    bins = 1 << 12

    def __init__(self):
        code = torch.tensor(NF4_VALUES, dtype=torch.float32)
        mids = (code[:-1] + code[1:]) / 2
        edges = torch.arange(self.bins + 1, dtype=torch.float64) * (2.0 / self.bins) - 1
        home = torch.floor((mids.double() + 1) * (self.bins / 2)).long()
        if (mids.double()[:, None] - edges).abs().min() < 1e-5 or len(set(home.tolist())) != len(mids):
            raise AssertionError("NF4 table: a midpoint sits on a bin edge or two share a bin; change `bins`.")
        lower = torch.bucketize(edges[:-1].float(), mids)  # the code at each bin's start
        self.mids, self.code = mids, code
        self.mid = torch.full((self.bins,), float("inf"))
        self.mid[home] = mids
        self.low, self.high = code[lower], code[(lower + 1).clamp(max=len(code) - 1)]

    def round(self, scaled: torch.Tensor) -> torch.Tensor:
        """NF4 value of each element of `scaled` (fp32 in [-1, 1])."""
        b = scaled.add(1).mul_(self.bins / 2).to(torch.int32).clamp_(0, self.bins - 1).long()
        return torch.where(scaled > self.mid[b], self.high[b], self.low[b])


_NF4 = _NF4Table()


def _nf4_roundtrip(blocks: torch.Tensor) -> torch.Tensor:
    """deq(q(x)) for fp32 rows of 64 elements, with bitsandbytes' arithmetic (default CPU `quantize_4bit`)."""
    absmax = blocks.abs().amax(dim=-1, keepdim=True)
    scaled = torch.clamp(blocks * (1.0 / absmax.clamp(min=1e-38)), -1, 1)
    return _NF4.round(scaled).mul_(absmax)


def nf4_dequantized(weight: torch.Tensor) -> torch.Tensor:
    """The weight bitsandbytes' NF4 (blocksize 64, fp32 absmax) would reconstruct, as fp32 of the same shape.

    bitsandbytes blocks the row-major flattened tensor; a last partial block is padded with zeros here, which
    changes neither its absmax nor any reconstructed value.
    """
    flat = weight.detach().reshape(-1).float()
    pad = -flat.numel() % NF4_BLOCK_SIZE
    blocks = torch.nn.functional.pad(flat, (0, pad)).reshape(-1, NF4_BLOCK_SIZE)
    return _nf4_roundtrip(blocks).reshape(-1)[: flat.numel()].reshape(weight.shape)


def nvfp4_dequantized(weight: torch.Tensor) -> torch.Tensor:
    """The weight PACT's NVFP4 would reconstruct, as fp32 of the same shape (`optimum_pact.nvfp4.fake_quantize`)."""
    return fake_quantize(weight)


def check_rank_by(rank_by: str, option: str = "rank_by") -> None:
    """One of `RANK_BY`, else a clear error naming `option`."""
    if rank_by not in RANK_BY:
        raise OptionError(option, f"{option}={rank_by!r} is not a known ranking; choose one of {', '.join(RANK_BY)}.")


def error_format(rank_by: str) -> str:
    """The reconstruction-error format `rank_by` ranks by from the weights alone: "auto" (without a calibration batch)
    is "nvfp4"; "sensitivity" has none, a clear error."""
    check_rank_by(rank_by)
    if rank_by == "sensitivity":
        raise ValueError(
            f"rank_by={rank_by!r} needs a calibration batch, not the weights alone: rank with "
            "PactConfig.with_calibration(model, batch) (PactTrainer and `pact finetune` use the first training batch)."
        )
    return "nvfp4" if rank_by == "auto" else rank_by


def reconstruction_error(weight: torch.Tensor, rank_by: str = "nvfp4") -> float:
    """||W - deq(q(W))||_F / ||W||_F for NF4 (`rank_by="nf4"`) or NVFP4 (`"nvfp4"`, `"auto"`); 0.0 for a zero weight.

    Works through W in chunks of rows (about `CHUNK_ELEMENTS` at a time) so a 0.5B model ranks in seconds and
    never holds more than a few copies of one chunk; sums are accumulated in float64.
    """
    rank_by = error_format(rank_by)
    if weight.dim() != 2 or not weight.dtype.is_floating_point:
        raise ValueError(
            f"reconstruction_error needs a 2-D floating weight; got {weight.dtype} {tuple(weight.shape)}."
        )
    if rank_by == "nvfp4" and weight.shape[1] % BLOCK_SIZE:
        raise ValueError(f"NVFP4 needs in_features to be a multiple of {BLOCK_SIZE}; got shape {tuple(weight.shape)}.")
    w, scale_2 = weight.detach(), None
    if rank_by == "nf4":  # bitsandbytes blocks the flattened tensor: chunk whole 64-element blocks (zero-padded)
        flat = w.reshape(-1)
        w = torch.nn.functional.pad(flat, (0, -flat.numel() % NF4_BLOCK_SIZE)).reshape(-1, NF4_BLOCK_SIZE)
    else:
        scale_2 = tensor_scale(w)  # NVFP4's per-tensor scale is the whole weight's, in every chunk
    rows = max(1, CHUNK_ELEMENTS // w.shape[1])
    err = ref = 0.0
    for start in range(0, w.shape[0], rows):
        chunk = w[start : start + rows].float()
        recon = _nf4_roundtrip(chunk) if scale_2 is None else fake_quantize(chunk, scale_2)
        err += torch.sum((chunk - recon).double().square()).item()
        ref += torch.sum(chunk.double().square()).item()
    return math.sqrt(err / ref) if ref > 0 else 0.0


def rank_layers(model: nn.Module, rank_by: str = "nvfp4") -> list[tuple[str, float]]:
    """(name, relative reconstruction error) for every decoder linear, largest error first, ties by name.

    Only the error rankings work from the weights alone; `rank_by="sensitivity"` is `PactConfig.with_calibration`.
    """
    rank_by = error_format(rank_by)
    errors = [(name, reconstruction_error(layer.weight, rank_by)) for name, layer in decoder_linears(model).items()]
    return sorted(errors, key=lambda item: (-item[1], item[0]))


def check_protect_fraction(protect_fraction: float, option: str = "protect_fraction") -> None:
    """A fraction in [0, 1], else a clear error naming `option` (e.g. "PactConfig.protect_fraction")."""
    if isinstance(protect_fraction, bool) or not isinstance(protect_fraction, (int, float)):
        raise TypeError(f"{option} must be a number in [0, 1]; got {protect_fraction!r}.")
    if not 0.0 <= protect_fraction <= 1.0:
        raise OptionError(
            option,
            f"{option}={protect_fraction!r} is outside the valid range [0, 1]: it is the fraction of decoder linears "
            "kept 16-bit (e.g. 0.2 keeps the worst fifth); 0 protects none.",
        )


def _protect_count(protect_fraction: float, n: int) -> int:
    check_protect_fraction(protect_fraction)
    return math.floor(protect_fraction * n + 0.5)  # round half up: 0.5 * 5 layers protects 3, not Python's 2


def choose_protected(
    model_or_ranking: nn.Module | Sequence[tuple[str, float]], protect_fraction: float, rank_by: str = "nvfp4"
) -> list[str]:
    """The `round(protect_fraction * n)` decoder linears with the largest reconstruction error, worst first.

    Pass a model (ranked here with `rank_by`) or a ranking from `rank_layers` (then `rank_by` is unused). The result
    depends only on the weights: ties are broken by name.
    """
    if isinstance(model_or_ranking, nn.Module):
        _protect_count(protect_fraction, 1)  # fail before the ranking pass
        ranking = rank_layers(model_or_ranking, rank_by)
    else:
        ranking = sorted(model_or_ranking, key=lambda item: (-item[1], item[0]))
    return [name for name, _ in ranking[: _protect_count(protect_fraction, len(ranking))]]
