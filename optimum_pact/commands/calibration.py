"""What the linears of a trained model see: the second moment of their inputs on the person's training items, which
GPTQ rounding (`optimum_pact.nvfp4.gptq`) needs to merge an adapter into NVFP4 without losing what it learned.

The data never leaves the device: the items are the ones the adapter was trained on (`--data`; the main job's by
default), run through the model with the adapter active (no padding token is counted).
"""

from __future__ import annotations

import torch
from torch import nn
from tqdm.auto import tqdm

from .data.generative import tokenize_generative
from .finetune import load_data, tokenize_examples
from .rounded_base import record_moments

MAX_ROWS = 256  # training items the moments are taken over: a few thousand tokens, enough for GPTQ at this size


def calibration_rows(tokenizer, data: str | None, max_rows: int = MAX_ROWS) -> list[list[int]]:
    """Token ids of the first `max_rows` training items of `data` (a file, a built-in example's name or None: the
    main job's notes), formatted as training formatted them."""
    form, train, _ = load_data(data)
    rows = tokenize_examples(tokenizer, train) if form == "labelled" else tokenize_generative(tokenizer, train, form)
    return [row["input_ids"] for row in rows[:max_rows]]


@torch.no_grad()
def input_hessians(
    model: nn.Module, layers: dict[str, nn.Module], rows: list[list[int]], batch_size: int = 16
) -> dict[str, torch.Tensor]:
    """`{name: sum of x x^T}` (fp32 [K, K]) over the inputs `x` each of `layers` sees while `model` runs `rows`
    (`batch_size` at a time, padded on the right; the padding's positions are left out; `record_moments`).
    Layers that read the same tensor (q, k and v; gate and up) share one sum: the same object under each name."""
    sums: dict[str, torch.Tensor] = {}
    shared: dict[str, str] = {}  # a layer's name -> the layer whose sum it shares
    real: list[torch.Tensor] = [torch.zeros(0, dtype=torch.bool)]  # which flattened positions of the batch are tokens
    handles = record_moments(layers, sums, shared, real)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        for start in tqdm(range(0, len(rows), batch_size), desc="calibrating the merge", unit="batch", leave=False):
            batch = rows[start : start + batch_size]
            width = max(len(ids) for ids in batch)
            mask = torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids in batch])
            ids = torch.tensor([ids + [0] * (width - len(ids)) for ids in batch])  # padded on the right: causal
            real[0] = mask.reshape(-1).bool()  # attention keeps every real token from seeing the padding after it
            model(input_ids=ids.to(device), attention_mask=mask.to(device))
    finally:
        for handle in handles:
            handle.remove()
        model.train(was_training)
    return {name: sums[shared.get(name, name)] for name in layers if shared.get(name, name) in sums}


__all__ = ["MAX_ROWS", "calibration_rows", "input_hessians"]
