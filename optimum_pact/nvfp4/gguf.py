"""NVFP4 in llama.cpp's block layout (GGML type NVFP4, gguf's `GGMLQuantizationType.NVFP4`): the same codes and e4m3
block scales as PACT's `NVFP4Tensor`, moved, not rounded again.

A GGML NVFP4 block holds 64 weights of a row in 36 bytes: the 4 block scales of its 16-weight groups as UE4M3 (the
e4m3 byte without its sign bit; PACT's scales are positive, so the byte is the same), then 4 x 8 bytes of codes,
one group after the other. Inside a group of 16, weight j sits in the LOW nibble of byte j and weight j + 8 in its
high nibble; PACT (ModelOpt) puts weight 2i in the low nibble of byte i. llama.cpp multiplies the product by the
per-tensor `scale_2` afterwards, from a float32 tensor `<name>.scale` beside the weight.
"""

from __future__ import annotations

import numpy as np
import torch

from .format import BLOCK_SIZE, pack_e2m1, unpack_e2m1

GGML_BLOCK = 64  # weights per GGML NVFP4 block
GGML_BLOCK_BYTES = 4 + GGML_BLOCK // 2  # 4 UE4M3 scales, then 32 bytes of codes


def to_ggml_nvfp4(qdata: torch.Tensor, scale: torch.Tensor) -> np.ndarray:
    """PACT's packed codes `qdata` uint8 [N, K/2] and block scales `scale` float8_e4m3fn [N, K/16] as GGML NVFP4
    blocks, uint8 [N, K/64 * 36]. K must be a multiple of 64."""
    n, k = qdata.shape[0], qdata.shape[1] * 2
    if k % GGML_BLOCK:
        raise ValueError(
            f"llama.cpp's NVFP4 packs rows in blocks of {GGML_BLOCK} weights; a weight of shape ({n}, {k}) does not "
            "fit. Keep this linear 16-bit (export --keep_16bit, or leave it out of the NVFP4 base)."
        )
    groups = unpack_e2m1(qdata).reshape(n, k // BLOCK_SIZE, 2, BLOCK_SIZE // 2)  # [N, groups, halves, 8]
    codes = groups[:, :, 0] | (groups[:, :, 1] << 4)  # weight j low, weight j + 8 high
    codes = codes.reshape(n, k // GGML_BLOCK, GGML_BLOCK // 2)
    scales = (scale.view(torch.uint8) & 0x7F).reshape(n, k // GGML_BLOCK, 4)
    return torch.cat((scales, codes), dim=-1).reshape(n, -1).numpy()


def from_ggml_nvfp4(blocks: np.ndarray, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of `to_ggml_nvfp4`: GGML NVFP4 blocks of rows of `k` weights -> (qdata uint8 [N, K/2], scale
    float8_e4m3fn [N, K/16]) in PACT's layout."""
    raw = torch.from_numpy(np.array(blocks, dtype=np.uint8)).reshape(-1, k // GGML_BLOCK, GGML_BLOCK_BYTES)
    n = raw.shape[0]
    scale = raw[:, :, :4].reshape(n, k // BLOCK_SIZE).contiguous().view(torch.float8_e4m3fn)
    codes = raw[:, :, 4:].reshape(n, k // BLOCK_SIZE, BLOCK_SIZE // 2)
    weights = torch.stack((codes & 0x0F, codes >> 4), dim=2).reshape(n, k)  # low nibbles first, then high
    return pack_e2m1(weights), scale


def llama_rows(x: torch.Tensor, heads: int) -> torch.Tensor:
    """The rows of a q_proj/k_proj weight (or of its block scales) in llama.cpp's llama order: HF's Llama rotates
    each head's two halves, llama.cpp neighbouring pairs, so each head's halves [x0..x(d/2-1) | y0..] become
    x0 y0 x1 y1 ... (what llama.cpp's converter does to the same rows)."""
    return x.reshape(heads, 2, x.shape[0] // heads // 2, *x.shape[1:]).transpose(1, 2).reshape(x.shape)


__all__ = ["GGML_BLOCK", "GGML_BLOCK_BYTES", "from_ggml_nvfp4", "llama_rows", "to_ggml_nvfp4"]
