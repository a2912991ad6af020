"""Softmax over a semantically relevant token subset, and the chunked cross-entropy that computes it.

For a position whose target is token `y`, the loss is the cross-entropy over `S(y)`: `y` itself plus the k - 1
tokens whose output-embedding rows are nearest to `y`'s by cosine similarity (`TokenNeighbours`):

    loss = logsumexp_{j in S(y)} z_j - z_y            with z_j = h . W_j (+ b_j)

What the approximation does:
- **Loss**: the sum over the subset leaves out the rest of the vocabulary, so the subset loss is a lower bound of
  the full cross-entropy (`logsumexp` over fewer terms) and equals it when k = vocabulary size. The gap is the
  probability mass the model puts outside `S(y)`: small once that mass concentrates on tokens like the target,
  large early in training or for a random model (reported loss values are not comparable to full-softmax ones).
- **Gradients**: d loss / d z_j = p_j - 1[j = y] with p the softmax over the subset only, and 0 for every token
  outside it. The target is pulled up exactly as in the full softmax; only the k - 1 near neighbours (the hard
  negatives the model confuses with the target) are pushed down, each more strongly than in the full softmax
  because the subset's probabilities sum to one. Far tokens get no push-down at all, which is what can let their
  logits drift up; it is harmless for LoRA fine-tuning of a pretrained model (those tokens start far below) and
  is why the subset must hold the nearest tokens rather than random ones.
- The output layer must be frozen (no gradient for its weight); the hidden states get their gradient.

Memory: the logits are [tokens, k], never [tokens, vocab]; tokens are processed in chunks (gathered weight rows
[chunk, k, hidden] at a time) and the gradient with respect to the hidden states is computed in the same pass, so
nothing of size k survives the forward. The neighbour rows are computed once per token id and kept (int32).
"""

from __future__ import annotations

import torch

DEFAULT_K = 1000  # the published stack's top-1000 softmax approximation
CHUNK_BYTES = 8 * 2**20  # gathered weight rows (or full-vocab logits) per chunk of tokens


def check_subset_k(k: int, vocab_size: int) -> None:
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"subset softmax k={k!r} must be a positive integer (default {DEFAULT_K}).")
    if k > vocab_size:
        raise ValueError(
            f"subset softmax k={k} is larger than the vocabulary ({vocab_size} tokens). Use k <= {vocab_size} "
            f"(k = {vocab_size} is the exact full softmax), or turn the subset softmax off (subset_k=None)."
        )


class TokenNeighbours:
    """For each token id, the k ids nearest to it by cosine similarity of the output-embedding rows, itself first.

    Rows are computed on first use, for the ids asked (`__call__`) or in advance (`precompute`), in chunks of
    `query_chunk` ids against `vocab_chunk` vocabulary rows at a time, so no [vocab, vocab] matrix is ever built;
    each id's row is computed once and kept. A full table costs vocab x k x 4 bytes (608 MB for a 151,936-token
    vocabulary at k = 1000), so only the ids that occur as targets are computed.
    """

    def __init__(self, weight: torch.Tensor, k: int = DEFAULT_K, query_chunk: int = 256, vocab_chunk: int = 16384):
        vocab_size = weight.shape[0]
        check_subset_k(k, vocab_size)
        self.weight, self.k = weight.detach(), k
        self.query_chunk, self.vocab_chunk = query_chunk, vocab_chunk
        self._inv_norm: torch.Tensor | None = None
        self._rows: dict[int, torch.Tensor] = {}

    @property
    def vocab_size(self) -> int:
        return self.weight.shape[0]

    def _inverse_norms(self) -> torch.Tensor:
        if self._inv_norm is None:
            norms = torch.cat([c.float().norm(dim=-1) for c in self.weight.split(self.vocab_chunk)])
            self._inv_norm = 1.0 / norms.clamp_min(1e-12)
        return self._inv_norm

    def precompute(self, ids: torch.Tensor | list[int] | None = None) -> None:
        """Compute the rows of `ids` (all the vocabulary when None) that are not known yet."""
        ids = torch.arange(self.vocab_size) if ids is None else torch.as_tensor(ids).flatten().unique()
        missing = [i for i in ids.tolist() if i not in self._rows]
        for start in range(0, len(missing), self.query_chunk):
            chunk = torch.tensor(missing[start : start + self.query_chunk])
            for i, row in zip(chunk.tolist(), self._nearest(chunk)):
                self._rows[i] = row.to(torch.int32).clone()

    def _nearest(self, ids: torch.Tensor) -> torch.Tensor:
        inv = self._inverse_norms()
        query = self.weight[ids].float() * inv[ids, None]
        best_val = query.new_empty(len(ids), 0)
        best_idx = torch.empty(len(ids), 0, dtype=torch.long)
        for v0 in range(0, self.vocab_size, self.vocab_chunk):
            rows = self.weight[v0 : v0 + self.vocab_chunk].float() * inv[v0 : v0 + self.vocab_chunk, None]
            sims = query @ rows.t()
            own = (ids >= v0) & (ids < v0 + rows.shape[0])
            sims[own.nonzero().flatten(), ids[own] - v0] = float("inf")  # the target itself comes first
            best_val = torch.cat([best_val, sims], dim=1)
            best_idx = torch.cat([best_idx, torch.arange(v0, v0 + rows.shape[0]).expand(len(ids), -1)], dim=1)
            keep = min(self.k, best_val.shape[1])
            best_val, order = best_val.topk(keep, dim=1)
            best_idx = best_idx.gather(1, order)
        return best_idx

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        """[n, k] int32 subsets for the target ids `ids` [n]; column 0 is the target."""
        ids = ids.flatten()
        uniq, inverse = ids.unique(return_inverse=True)
        self.precompute(uniq)
        if not len(uniq):
            return torch.empty(0, self.k, dtype=torch.int32)
        return torch.stack([self._rows[i] for i in uniq.tolist()])[inverse]

    def __len__(self) -> int:
        return len(self._rows)


class ChunkedCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy of `hidden @ weight.T (+ bias)` over each token's subset (or the whole vocabulary).

    Forward computes, chunk by chunk, the loss and d loss / d hidden; backward only scales that gradient. Nothing
    of size [tokens, k] or [tokens, vocab] is kept.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, subsets, chunk_tokens):
        n = hidden.shape[0]
        losses = torch.empty(n, dtype=torch.float32, device=hidden.device)
        grad = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        for s in range(0, n, chunk_tokens):
            h = hidden[s : s + chunk_tokens]
            if subsets is None:
                rows = weight
                z = h @ weight.t()
                if bias is not None:
                    z = z + bias
                target_col = targets[s : s + chunk_tokens]
            else:
                idx = subsets[s : s + chunk_tokens].long()
                rows = weight[idx]  # [c, k, hidden]
                z = torch.bmm(rows, h.unsqueeze(-1)).squeeze(-1)
                if bias is not None:
                    z = z + bias[idx]
                target_col = torch.zeros(len(idx), dtype=torch.long, device=h.device)
            z = z.float()
            lse = z.logsumexp(-1)
            losses[s : s + chunk_tokens] = lse - z.gather(1, target_col[:, None]).squeeze(1)
            if grad is not None:
                p = (z - lse[:, None]).exp_()
                p[torch.arange(len(p)), target_col] -= 1.0
                p = p.to(rows.dtype)
                grad[s : s + chunk_tokens] = p @ rows if subsets is None else (p.unsqueeze(1) @ rows).squeeze(1)
                del p
            del rows, z  # before the next chunk's gather: one chunk's rows at a time
        ctx.grad_hidden = grad
        return losses

    @staticmethod
    def backward(ctx, grad_losses):
        grad = ctx.grad_hidden
        ctx.grad_hidden = None
        return grad * grad_losses[:, None].to(grad.dtype), None, None, None, None, None


def chunk_tokens_for(row_bytes: int) -> int:
    """Tokens per chunk so that one chunk's gathered rows (or logits) stay under CHUNK_BYTES."""
    return max(1, CHUNK_BYTES // max(1, row_bytes))


def subset_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    neighbours: TokenNeighbours | None = None,
    bias: torch.Tensor | None = None,
    chunk_tokens: int | None = None,
) -> torch.Tensor:
    """Per-token losses [n] for `hidden` [n, hidden_size] and `targets` [n] (no -100 entries).

    `neighbours=None` is the full-vocabulary cross-entropy, computed in chunks of tokens.
    """
    if weight.requires_grad or (bias is not None and bias.requires_grad):
        raise ValueError(
            "The chunked (subset) cross-entropy needs a frozen output layer: lm_head.weight requires grad here. "
            "Freeze it (LoRA leaves it frozen unless it is in modules_to_save or the embeddings are trained), or "
            "turn subset_k and mask_logits off."
        )
    if neighbours is not None and neighbours.vocab_size != weight.shape[0]:
        raise ValueError(
            f"TokenNeighbours was built for {neighbours.vocab_size} tokens but the output layer has "
            f"{weight.shape[0]}; build it from this model's output embedding."
        )
    subsets = neighbours(targets) if neighbours is not None else None
    if chunk_tokens is None:
        width = weight.shape[0] * 4 if subsets is None else subsets.shape[1] * weight.shape[1] * weight.element_size()
        chunk_tokens = chunk_tokens_for(width)
    return ChunkedCrossEntropy.apply(hidden, weight, bias, targets, subsets, chunk_tokens)
