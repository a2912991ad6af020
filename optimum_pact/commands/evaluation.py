"""Held-out evaluation: pick the tag whose tokens the model finds most likely after the prompt.

A label of L tokens is scored from one sequence `prompt + label[:-1]`: the last L positions predict its L tokens.
Labels that share `label[:-1]` share that sequence, so single-token labels (the usual case) cost one short forward
pass per text for all candidates together.
"""

from __future__ import annotations

import torch

from .data import PROMPT_TEMPLATE, format_example


def _forward_last(model, sequences: list[list[int]], keep: int, pad_id: int) -> torch.Tensor:
    """Log-probabilities (float32) predicted at the last `keep` positions of each left-padded sequence."""
    device = next(model.parameters()).device
    width = max(len(s) for s in sequences)
    input_ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, seq in enumerate(sequences):
        input_ids[row, width - len(seq) :] = torch.tensor(seq)
        attention_mask[row, width - len(seq) :] = 1
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    inputs = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}
    inputs = {name: tensor.to(device) for name, tensor in inputs.items()}
    # `logits_to_keep` as indices, not an int: transformers then gathers a contiguous copy of the last hidden states.
    # With an int it slices a strided view, and torch 2.13's CPU linear on a frozen bf16 weight and a strided 3-D
    # input transiently allocates ~430 MiB for SmolLM2's 49152 x 576 lm_head, the largest allocation of evaluation.
    last = torch.arange(width - keep, width, device=device)
    try:
        logits = model(**inputs, logits_to_keep=last).logits
    except TypeError:  # a model whose forward has no `logits_to_keep`
        logits = model(**inputs).logits
    return torch.log_softmax(logits[:, -keep:].float(), dim=-1)


def score_labels(model, tokenizer, texts: list[str], labels: list[str], batch_size: int = 16) -> torch.Tensor:
    """Summed log-probability of each " " + label after each text's prompt: a float32 (texts, labels) tensor.

    Works on a plain Hugging Face causal LM and on a peft-wrapped one; the model is put in eval mode and its
    training mode restored afterwards. `batch_size` counts texts per forward pass.
    """
    if not labels:
        raise ValueError("need at least one candidate label")
    label_ids = [tokenizer(format_example("", label)[1], add_special_tokens=False)["input_ids"] for label in labels]
    if any(not ids for ids in label_ids):
        raise ValueError(f"a label tokenizes to nothing: {labels}")
    prefixes = list(dict.fromkeys(tuple(ids[:-1]) for ids in label_ids))  # one sequence per distinct prefix
    prefix_of_label = torch.tensor([prefixes.index(tuple(ids[:-1])) for ids in label_ids])
    keep = max(len(ids) for ids in label_ids)
    targets = torch.zeros(len(labels), keep, dtype=torch.long)  # right-aligned: column keep-L+k holds token k
    is_target = torch.zeros(len(labels), keep, dtype=torch.bool)
    for j, ids in enumerate(label_ids):
        targets[j, keep - len(ids) :] = torch.tensor(ids)
        is_target[j, keep - len(ids) :] = True
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    pad_id = pad_id if pad_id is not None else 0

    was_training = model.training
    model.eval()
    scores = []
    try:
        with torch.no_grad():
            for start in range(0, len(texts), batch_size):
                chunk = texts[start : start + batch_size]
                prompts = [tokenizer(PROMPT_TEMPLATE.format(text=text))["input_ids"] for text in chunk]
                sequences = [prompt + list(prefix) for prompt in prompts for prefix in prefixes]
                logprobs = _forward_last(model, sequences, keep, pad_id).cpu()
                logprobs = logprobs.view(len(chunk), len(prefixes), keep, -1)[:, prefix_of_label]
                index = targets.expand(len(chunk), -1, -1).unsqueeze(-1)
                scores.append((logprobs.gather(-1, index).squeeze(-1) * is_target).sum(-1))
    finally:
        model.train(was_training)
    return torch.cat(scores) if scores else torch.zeros(0, len(labels))


def classify(model, tokenizer, texts: list[str], labels: list[str], batch_size: int = 16) -> list[str]:
    """Return, for each text, the label whose " " + label tokens have the highest summed log-probability."""
    scores = score_labels(model, tokenizer, texts, labels, batch_size)
    return [labels[j] for j in scores.argmax(-1).tolist()]


def accuracy(preds: list[str], golds: list[str]) -> float:
    """Fraction of predictions equal to the gold labels."""
    if len(preds) != len(golds):
        raise ValueError(f"accuracy got {len(preds)} predictions for {len(golds)} gold labels")
    if not golds:
        raise ValueError("accuracy needs at least one example")
    return sum(p == g for p, g in zip(preds, golds)) / len(golds)


def heldout_loss(model, rows: list[dict], collator, batch_size: int = 8) -> float:
    """Mean cross-entropy per learned token (labels != -100) over `rows`; perplexity is its exp."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    try:
        with torch.no_grad():
            for start in range(0, len(rows), batch_size):
                batch = {k: v.to(device) for k, v in collator(rows[start : start + batch_size]).items()}
                labels = batch.pop("labels")
                logits = model(**batch).logits[:, :-1].float()
                targets = labels[:, 1:]
                losses = torch.nn.functional.cross_entropy(
                    logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100, reduction="sum"
                )
                total += losses.item()
                count += int((targets != -100).sum())
    finally:
        model.train(was_training)
    if count == 0:
        raise ValueError("no held-out token to score: every label is -100")
    return total / count


def answer(model, tokenizer, prompt: list[int], max_new_tokens: int = 40) -> str:
    """The model's greedy continuation of `prompt` (token ids), decoded, up to the end of sequence."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            ids = torch.tensor([prompt], device=device)
            pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
            out = model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                do_sample=False, pad_token_id=pad,
            )  # fmt: skip
    finally:
        model.train(was_training)
    return tokenizer.decode(out[0, len(prompt) :], skip_special_tokens=True).strip()
