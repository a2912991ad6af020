"""Logits masking: the causal-LM loss computed from the hidden states, with the output head run only where labels are.

`causal_lm_loss` runs the decoder, shifts the labels as transformers' causal LM loss does (position t predicts
label t + 1; the last position predicts nothing), keeps the positions whose shifted label is not -100 and runs the
output head there only, through the chunked cross-entropy of `subset_softmax` (full vocabulary, or a token subset).
Prompt tokens (labels -100) never get logits. The loss is the mean over labelled positions (or the sum divided by
`num_items_in_batch`, as the Trainer passes it under gradient accumulation), exactly as `model(..., labels=...)`.
"""

from __future__ import annotations

import torch
from torch import nn

from .subset_softmax import TokenNeighbours, batch_negatives, subset_cross_entropy

IGNORE_INDEX = -100
DECODER_KWARGS_DROPPED = ("labels", "num_items_in_batch", "return_dict", "output_attentions", "output_hidden_states")


def shifted_targets(labels: torch.Tensor) -> torch.Tensor:
    """[batch, seq - 1] targets: label t + 1 for position t (transformers' ForCausalLMLoss shift)."""
    return labels[..., 1:]


def labelled_positions(labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat indices into [batch * (seq - 1)] positions that have a label, and those labels."""
    targets = shifted_targets(labels).reshape(-1)
    index = (targets != IGNORE_INDEX).nonzero().flatten()
    return index, targets[index]


def output_layer(model: nn.Module) -> nn.Linear:
    """The model's output head, which must be a plain frozen `nn.Linear` (LoRA on lm_head is not supported)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else model.lm_head
    if type(head) is not nn.Linear:
        raise ValueError(
            f"Logits masking and the subset softmax need the output head to be a plain nn.Linear; this model's is "
            f"{type(head).__name__}. Leave lm_head out of target_modules / modules_to_save, or turn "
            "mask_logits and subset_k off."
        )
    return head


def decoder_of(model: nn.Module) -> nn.Module:
    """The decoder stack (embeddings, blocks, final norm) of a causal LM or of a peft model wrapping one."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if hasattr(base, "get_decoder"):
        return base.get_decoder()
    if hasattr(base, "model"):
        return base.model
    raise ValueError(f"{type(base).__name__} has no decoder (get_decoder() / .model); memory savers need a causal LM.")


def causal_lm_loss(
    model: nn.Module,
    input_ids: torch.Tensor | None,
    labels: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    neighbours: TokenNeighbours | None = None,
    mask_logits: bool = True,
    num_items_in_batch: int | torch.Tensor | None = None,
    stream=None,
    **decoder_kwargs,
) -> torch.Tensor:
    """The causal-LM training loss of `model` on a batch, without [tokens, vocab] logits.

    `mask_logits=False` computes the head at every position and multiplies unlabelled ones by 0 (the cost of not
    masking; the value is the same). `neighbours=None` uses the full vocabulary. `stream`: a `WeightStream` releasing
    the output weight's rows as the loss reads them.
    """
    head = output_layer(model)
    kwargs = {k: v for k, v in decoder_kwargs.items() if v is not None and k not in DECODER_KWARGS_DROPPED}
    kwargs.setdefault("use_cache", False)  # a KV cache is useless in training (transformers would fill one)
    out = decoder_of(model)(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
    hidden = out[0] if isinstance(out, (tuple, list)) else out.last_hidden_state
    hidden = hidden[..., :-1, :].reshape(-1, hidden.shape[-1])
    if mask_logits:
        index, targets = labelled_positions(labels)
        losses = subset_cross_entropy(hidden[index], head.weight, targets, neighbours, head.bias, stream=stream)
        total = losses.sum()
    else:
        targets = shifted_targets(labels).reshape(-1)
        labelled = targets != IGNORE_INDEX
        negatives = None
        if neighbours is not None:  # the batch's labelled targets, not the 0 placeholders of unlabelled positions
            negatives = batch_negatives(targets[labelled], neighbours.k)
        losses = subset_cross_entropy(
            hidden, head.weight, targets.clamp_min(0), neighbours, head.bias, negatives=negatives, stream=stream
        )
        total = torch.where(labelled, losses, 0.0).sum()
        index = labelled.nonzero()
    if num_items_in_batch is None:
        return total / len(index)  # nan when nothing is labelled, like cross_entropy(reduction="mean")
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch
