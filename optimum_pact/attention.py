"""Attention for training on the CPU at short lengths: `"pact_sdpa"`, registered with transformers' AttentionInterface.

sdpa's CPU flash kernel costs little forward but its backward has a fixed cost per (row, head): on SmolLM2-135M's
shapes (one layer, forward + backward, bf16, 2-core Xeon with AMX; benchmarks/bench_attention.py) 3.39 ms for
8 rows x 20 tokens against 1.07 ms as plain matmuls + softmax, 3.17 against 1.38 ms for one packed row of 135 (8
examples, split as below), 7.84 against 6.95 ms at 4 x 128; from ~300 tokens (1 x 300, 4 x 256) the two are even
and the flash kernel keeps its memory advantage. The main job's batches are ~20 tokens long (one packed row of ~135),
and there the flash backward was 17% of a training step (torch.profiler).

`pact_sdpa` therefore computes a layer's attention as matmuls in fp32 (scores, mask, softmax, weighted values:
nothing rounded to bf16 on the way, as the flash kernel accumulates in fp32) when autograd records it on the CPU, the
keys are at most `EAGER_MAX_LENGTH` and the scores at most `EAGER_MAX_SCORES`; everything else (inference, longer
sequences, other devices, features the matmul path does not implement) goes to transformers' own sdpa function,
unchanged. Masks are sdpa's (`sdpa_mask`: causal, padding, packed rows' blocks, sliding windows), so padding-free rows
keep their examples apart. Grouped-query heads are multiplied by their shared key/value head directly (no `repeat_kv`
copy).

A padding-free row (one row holding several examples, its mask causal within each) is split into its examples first:
each attends over its own tokens only, as a padded batch would, instead of the whole row's length squared with every
other example masked out (8 examples of ~17 tokens: 3.6x fewer scores).

`use_short_attention(model)` switches a model that runs sdpa to it (PactTrainer does for training, with
`pact_short_attention`); `model.set_attn_implementation("sdpa")` switches back.
"""

from __future__ import annotations

import weakref

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "pact_sdpa"
# Up to which key length and score count (batch x heads x queries x keys) a layer's attention runs as fp32 matmuls.
# The flash kernel's backward costs a fixed amount per (row, head) plus its share of the length squared, the matmuls
# only the latter: they won at 8 x 20, 8 x 40, 1 x 135 and 4 x 128 tokens and were no faster at 1 x 300 and 4 x 256
# (module docstring). The score bound caps what a layer keeps for backward: 8 MiB of fp32 probabilities.
EAGER_MAX_LENGTH = 192
EAGER_MAX_SCORES = 2**21
# What the matmul path leaves to sdpa, which implements it or says it does not
_SDPA_ONLY = ("softcap", "s_aux", "sinks", "position_bias", "output_attentions")


def _runs_eager(query: torch.Tensor, key: torch.Tensor, attention_mask: torch.Tensor | None, kwargs: dict) -> bool:
    batch, heads, q_len, _ = query.shape
    k_len = key.shape[2]
    if not (query.is_cpu and torch.is_grad_enabled() and k_len <= EAGER_MAX_LENGTH):
        return False
    if batch * heads * q_len * k_len > EAGER_MAX_SCORES:
        return False
    if (
        any(kwargs.get(name) is not None and kwargs.get(name) is not False for name in _SDPA_ONLY)
        or heads % key.shape[1]
    ):
        return False
    return attention_mask is None or (attention_mask.dim() == 4 and attention_mask.shape[1] == 1)


_last_segments: tuple | None = None  # (weakref to a mask, its version, what _packed_segments found): layers share one


def _packed_segments(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """For a mask [1, 1, T, T] that is exactly causal inside contiguous blocks and False across them (a padding-free
    row of two or more examples): where each token goes in the examples laid out as rows of the longest's length L
    (flat indices into n * L, [T]), and those rows' mask [n, 1, L, L] (causal over each example's own places; the
    places past its end attend too, and are dropped). None for every other mask. Computed once per mask tensor: the
    layers of one forward share it."""
    global _last_segments
    last = _last_segments
    if last is not None and last[0]() is mask and last[1] == mask._version:
        return last[2]
    found = None
    grid = mask[0, 0]
    t = grid.shape[-1]
    if grid.dtype == torch.bool and grid.shape == (t, t) and t > 1:
        first = grid.to(torch.uint8).argmax(-1)  # the first key each query sees: its example's first token
        pos = torch.arange(t, device=grid.device)
        if torch.equal(grid, (first[:, None] == first[None, :]) & (pos[None, :] <= pos[:, None])):
            starts = pos[first == pos]
            if len(starts) > 1:
                lengths = torch.diff(starts, append=torch.tensor([t], device=grid.device))
                longest = int(lengths.max())
                example = torch.cumsum(first == pos, 0) - 1  # each token's example
                place = example * longest + (pos - first)
                own = torch.arange(longest, device=grid.device)[None, :] < lengths[:, None]
                causal = torch.ones(longest, longest, dtype=torch.bool, device=grid.device).tril()
                found = (place, causal & own[:, None, None, :])
    _last_segments = (weakref.ref(mask), mask._version, found)
    return found


def short_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: query [B, H, Lq, D], key/value [B, Hkv, Lk, D], the mask
    `sdpa_mask` built (bool, True = attend; None = plain causal); returns ([B, Lq, H, D], None) as sdpa does."""
    if not _runs_eager(query, key, attention_mask, kwargs):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    segments = _packed_segments(attention_mask) if query.shape[0] == 1 and attention_mask is not None else None
    if segments is not None:  # a padding-free row: its examples as a batch of rows, each causal over its own tokens
        place, mask = segments
        n, longest = mask.shape[0], mask.shape[-1]
        # each token copied to its place, zeros after an example's end: index_copy and index_select, whose gradients
        # are each other (a gather and a scatter of distinct places), not an accumulating index_put
        q, k, v = (
            t[0].new_zeros(t.shape[1], n * longest, t.shape[3]).index_copy(1, place, t[0])
            .view(t.shape[1], n, longest, t.shape[3]).transpose(0, 1)
            for t in (query, key, value)
        )  # fmt: skip
        out, _ = _attend(module, q, k, v, mask, dropout, scaling, is_causal)  # [n, L, heads, D]
        return out.view(n * longest, *out.shape[2:]).index_select(0, place).unsqueeze(0), None  # [1, T, heads, D]
    return _attend(module, query, key, value, attention_mask, dropout, scaling, is_causal)


def _attend(module, query, key, value, attention_mask, dropout, scaling, is_causal) -> tuple[torch.Tensor, None]:
    """The matmul path on [B, H, Lq, D] / [B, Hkv, Lk, D] with sdpa's mask conventions; ([B, Lq, H, D], None)."""
    batch, heads, q_len, dim = query.shape
    kv_heads, k_len = key.shape[1], key.shape[2]
    groups = heads // kv_heads  # query heads h = g * groups + i share key/value head g
    scale = dim**-0.5 if scaling is None else scaling
    q = (query.float() * scale).reshape(batch, kv_heads, groups * q_len, dim)
    scores = (q @ key.float().transpose(-1, -2)).view(batch, kv_heads, groups, q_len, k_len)
    lowest, mask = torch.finfo(torch.float32).min, None  # not -inf: a row with nothing to attend to stays finite
    if attention_mask is not None:
        mask = attention_mask.unsqueeze(2)  # [B or 1, 1, 1, Lq, Lk] against the scores' [B, Hkv, groups, Lq, Lk]
        scores = scores.masked_fill(~mask, lowest) if mask.dtype == torch.bool else scores + mask.float()
    elif q_len > 1 and (is_causal if is_causal is not None else getattr(module, "is_causal", True)):
        future = torch.ones(q_len, k_len, dtype=torch.bool, device=query.device).triu(k_len - q_len + 1)
        scores = scores.masked_fill(future, lowest)
    probs = torch.softmax(scores, dim=-1)
    if mask is not None and mask.dtype == torch.bool:  # a query that may attend to nothing (a left pad) gets zeros,
        probs = probs.masked_fill(~mask.any(-1, keepdim=True), 0.0)  # as sdpa gives it, not the mean of every value
    if dropout > 0.0:
        probs = torch.nn.functional.dropout(probs, p=dropout, training=True)
    out = probs.view(batch, kv_heads, groups * q_len, k_len) @ value.float()
    return out.view(batch, heads, q_len, dim).to(query.dtype).transpose(1, 2).contiguous(), None


AttentionInterface.register(NAME, short_attention_forward)
AttentionMaskInterface.register(NAME, sdpa_mask)


def use_short_attention(model: torch.nn.Module) -> bool:
    """Switch `model` (a transformers model, or a peft model around one) from sdpa to `pact_sdpa`; True if it was
    switched. A model on another attention implementation (eager, flash, flex, a kernel) is left as it is."""
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) != "sdpa" or not hasattr(model, "set_attn_implementation"):
        return False
    model.set_attn_implementation(NAME)
    return getattr(model.config, "_attn_implementation", None) == NAME
