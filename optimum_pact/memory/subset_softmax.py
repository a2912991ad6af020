"""Softmax over a semantically relevant token subset, and the chunked cross-entropy that computes it.

For a position whose target is token `y`, the softmax runs over three groups of tokens, each token counted once:
- `y` itself and the k - 1 tokens whose output-embedding rows are nearest to `y`'s by cosine similarity
  (`TokenNeighbours`): the semantically relevant subset, the hard negatives;
- the other targets of the same batch (in-batch negatives, at most k of them);
- the far tokens, through a uniform sample of m = `samples` (default k) ids of the vocabulary V, shared by every
  position of the call: each drawn id not already in the position's subset S(y) stands for V / m tokens (its logit
  gets + log(V / m)), so the far part of the normalizer is estimated without bias instead of dropped:

    loss = log( sum_{j in S(y)} e^{z_j} + V / m * sum_{j in sample, j not in S(y)} e^{z_j} ) - z_y
    with z_j = h . W_j (+ b_j)

Why not the nearest tokens alone (measured on the main job: SmolLM2, built-in data, 60 steps, k = 1000,
`benchmarks/bench_memory.py --quality`): a fine-tune pulls its answer tokens up at every position, and with only
the target's neighbours in the softmax nothing pushes anything else down. The subset loss went to 0.0000 while
held-out accuracy fell from 23% to 17% (full softmax: 87%): every tag's first token rose everywhere. Adding the
batch's targets fixed that on one seed (85% vs 87%) but not on another (48% vs 80%, and 88% for the same PACT
model with the exact savers): far tokens drifted up unchecked and broke the multi-token answers, whose
continuation probabilities are normalized over the whole vocabulary at inference. The far sample closes that gap.

What the approximation does:
- **Loss**: an estimate of the full cross-entropy; the normalizer's estimate is unbiased (its log slightly low, by
  Jensen). It is exact when k = vocabulary size (nothing is far) and, with `samples=0`, a lower bound (the
  neighbours-and-batch loss alone).
- **Gradients**: d loss / d z_j = p_j - 1[j = y] with p the softmax over the weighted subset, 0 for far tokens not
  drawn. The target is pulled up as in the full softmax; neighbours and batch targets are pushed down by their own
  probability; a drawn far token by its probability, which carries the weight V / m, so far tokens are pushed down
  as the full softmax pushes them, in expectation.
- The output layer must be frozen (no gradient for its weight); the hidden states get their gradient.

Memory: the logits are [tokens, k + batch targets + samples] (at most 3k), never [tokens, vocab]; tokens are
processed in chunks (gathered weight rows [chunk, width, hidden] at a time) and the gradient with respect to the
hidden states is computed in the same pass, so nothing of that width survives the forward. The neighbour rows are
computed once per token id and kept (int32).
"""

from __future__ import annotations

import math

import torch

from ..errors import OptionError

DEFAULT_K = 1000  # the published stack's top-1000 softmax approximation
CHUNK_BYTES = 8 * 2**20  # gathered weight rows (or full-vocab logits) per chunk of tokens
VOCAB_CHUNK_BYTES = 16 * 2**20  # output-weight rows multiplied at once by the full-vocabulary loss


def check_subset_k(
    k: int, vocab_size: int | None = None, name: str = "subset softmax k", off: str = "subset_k=None"
) -> None:
    """`k` must be a positive integer, at most `vocab_size` when given; errors say `name` and how to turn it `off`."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise OptionError(name, f"{name}={k!r} must be a positive integer (default {DEFAULT_K}).")
    if vocab_size is not None and k > vocab_size:
        raise OptionError(
            name,
            f"{name}={k} is larger than the vocabulary ({vocab_size} tokens). Use {name} <= {vocab_size} "
            f"(= {vocab_size} is the exact full softmax), or turn the subset softmax off ({off}).",
        )


class TokenNeighbours:
    """For each token id, the k ids nearest to it by cosine similarity of the output-embedding rows, itself first.

    Rows are computed on first use, for the ids asked (`__call__`) or in advance (`precompute`), in chunks of
    `query_chunk` ids against `vocab_chunk` vocabulary rows at a time, so no [vocab, vocab] matrix is ever built;
    each id's row is computed once and kept. A full table costs vocab x k x 4 bytes (608 MB for a 151,936-token
    vocabulary at k = 1000), so only the ids that occur as targets are computed.
    """

    def __init__(
        self,
        weight: torch.Tensor,
        k: int = DEFAULT_K,
        query_chunk: int = 256,
        vocab_chunk: int = 16384,
        samples: int | None = None,
        seed: int = 0,
    ):
        vocab_size = weight.shape[0]
        check_subset_k(k, vocab_size)
        self.weight, self.k = weight.detach(), k
        self.samples = k if samples is None else samples  # far tokens sampled per call (see `far_sample`)
        self.generator = torch.Generator().manual_seed(seed)
        self.query_chunk, self.vocab_chunk = query_chunk, vocab_chunk
        self._inv_norm: torch.Tensor | None = None
        self._rows: dict[int, torch.Tensor] = {}
        self.stream = None  # a WeightStream: told of every chunk of the table read (memory savers set it)

    @property
    def vocab_size(self) -> int:
        return self.weight.shape[0]

    def _inverse_norms(self) -> torch.Tensor:
        if self._inv_norm is None:
            norms = []
            for chunk in self.weight.split(self.vocab_chunk):
                norms.append(_read(chunk.float().norm(dim=-1), self.weight, chunk.numel(), self.stream))
            self._inv_norm = 1.0 / torch.cat(norms).clamp_min(1e-12)
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
        query = self.weight[ids] if self.stream is None else self.stream.gather(self.weight, ids)
        query = query.float() * inv[ids, None]
        best_val = query.new_empty(len(ids), 0)
        best_idx = torch.empty(len(ids), 0, dtype=torch.long)
        for v0 in range(0, self.vocab_size, self.vocab_chunk):
            chunk = self.weight[v0 : v0 + self.vocab_chunk]
            rows = chunk.float() * inv[v0 : v0 + len(chunk), None]
            _read(rows, self.weight, chunk.numel(), self.stream)
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

    def far_sample(self, targets: torch.Tensor, negatives: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
        """A uniform sample of `samples` token ids (without replacement, shared by every position), the [n, samples]
        mask of those already explicit in a position's row (its target, neighbours or the batch's targets: counted
        there, so not again) and the log of the weight each stands for (vocab / samples). Empty when nothing is far.
        """
        m = min(self.samples, self.vocab_size) if self.k < self.vocab_size else 0
        far = torch.randperm(self.vocab_size, generator=self.generator)[:m]
        if m == 0:
            return far, torch.zeros(len(targets), 0, dtype=torch.bool), 0.0
        uniq, inverse = targets.flatten().unique(return_inverse=True)
        self.precompute(uniq)  # known already when called from subset_cross_entropy
        own = torch.stack([torch.isin(far, self._rows[u]) for u in uniq.tolist()])  # [unique targets, m]
        return far, own[inverse] | torch.isin(far, negatives.long().cpu()), math.log(self.vocab_size / m)


class ChunkedCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy of `hidden @ weight.T (+ bias)` over each token's subset (or the whole vocabulary).

    Forward computes, chunk by chunk, the loss and d loss / d hidden; backward only scales that gradient. Nothing
    of size [tokens, k] or [tokens, vocab] is kept. The whole vocabulary is read in slices of `VOCAB_CHUNK_BYTES`
    rows, each told to `stream` (a `WeightStream`, or None) after use, as are the rows a subset gathers.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, subsets, excluded, offsets, chunk_tokens, stream=None):
        n = hidden.shape[0]
        losses = torch.empty(n, dtype=torch.float32, device=hidden.device)
        grad = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        slices = weight.split(max(1, VOCAB_CHUNK_BYTES // (weight.shape[1] * weight.element_size())))
        for s in range(0, n, chunk_tokens):
            h = hidden[s : s + chunk_tokens]
            if subsets is None:
                rows = None
                z = torch.cat([_read(h @ w.t(), weight, w.numel(), stream) for w in slices], dim=1)
                if bias is not None:
                    z = z + bias
                target_col = targets[s : s + chunk_tokens]
            else:
                idx = subsets[s : s + chunk_tokens].long()
                rows = weight[idx] if stream is None else _gather(stream, weight, idx)  # [c, k, hidden]
                z = torch.bmm(rows, h.unsqueeze(-1)).squeeze(-1)
                if bias is not None:
                    z = z + bias[idx]
                if offsets is not None:  # log-weights of the sampled far tokens (0 for the explicit ones)
                    z = z + offsets
                if excluded is not None:  # a token listed twice in a row counts once
                    z = z.masked_fill(excluded[s : s + chunk_tokens], float("-inf"))
                target_col = torch.zeros(len(idx), dtype=torch.long, device=h.device)
            z = z.float()
            lse = z.logsumexp(-1)
            losses[s : s + chunk_tokens] = lse - z.gather(1, target_col[:, None]).squeeze(1)
            if grad is not None:
                p = (z - lse[:, None]).exp_()
                p[torch.arange(len(p)), target_col] -= 1.0
                p = p.to(weight.dtype)
                if subsets is None:
                    grad[s : s + chunk_tokens] = _vocab_product(p, weight, slices, stream)
                else:
                    grad[s : s + chunk_tokens] = (p.unsqueeze(1) @ rows).squeeze(1)
                del p
            del rows, z  # before the next chunk's gather: one chunk's rows at a time
        ctx.grad_hidden = grad
        return losses

    @staticmethod
    def backward(ctx, grad_losses):
        grad = ctx.grad_hidden
        ctx.grad_hidden = None
        return grad * grad_losses[:, None].to(grad.dtype), None, None, None, None, None, None, None, None


def _read(result: torch.Tensor, weight: torch.Tensor, numel: int, stream) -> torch.Tensor:
    """`result`, after telling `stream` that `numel` elements of `weight` were read."""
    if stream is not None:
        stream.touch(weight, numel * weight.element_size())
    return result


def _gather(stream, weight: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """`weight[idx]`, the rows read by `stream` (from the weights file, not through its mapping)."""
    ids, inverse = idx.reshape(-1).unique(return_inverse=True)
    return stream.gather(weight, ids)[inverse].view(*idx.shape, weight.shape[1])


def _vocab_product(p: torch.Tensor, weight: torch.Tensor, slices: tuple[torch.Tensor, ...], stream) -> torch.Tensor:
    """`p @ weight`, `weight` taken in its row `slices`: summed slice after slice, in a fixed order."""
    out, v0 = None, 0
    for w in slices:
        part = p[:, v0 : v0 + w.shape[0]]
        out = _read(part @ w if out is None else out.addmm_(part, w), weight, w.numel(), stream)
        v0 += w.shape[0]
    return out


def chunk_tokens_for(row_bytes: int) -> int:
    """Tokens per chunk so that one chunk's gathered rows (or logits) stay under CHUNK_BYTES."""
    return max(1, CHUNK_BYTES // max(1, row_bytes))


def with_batch_negatives(subsets: torch.Tensor, negatives: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows [target | negatives | neighbours] and a mask of the entries that repeat a token already in the row.

    `subsets` [n, k] has the target first and distinct ids; `negatives` [u] distinct ids. The mask is True where a
    negative is the row's target or where a neighbour is one of the negatives: every token then counts once.
    """
    n = subsets.shape[0]
    negatives = negatives.to(subsets.dtype)
    rows = torch.cat([subsets[:, :1], negatives.expand(n, -1), subsets[:, 1:]], dim=1)
    excluded = torch.cat(
        [
            torch.zeros(n, 1, dtype=torch.bool, device=subsets.device),
            negatives[None, :] == subsets[:, :1],
            torch.isin(subsets[:, 1:], negatives),
        ],
        dim=1,
    )
    return rows, excluded


def batch_negatives(targets: torch.Tensor, limit: int) -> torch.Tensor:
    """The distinct targets of a batch, the `limit` most frequent when there are more."""
    ids, counts = targets.unique(return_counts=True)
    if len(ids) > limit:
        ids = ids[counts.topk(limit).indices]
    return ids


def subset_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    neighbours: TokenNeighbours | None = None,
    bias: torch.Tensor | None = None,
    chunk_tokens: int | None = None,
    negatives: torch.Tensor | None = None,
    stream=None,
) -> torch.Tensor:
    """Per-token losses [n] for `hidden` [n, hidden_size] and `targets` [n] (no -100 entries).

    `neighbours=None` is the full-vocabulary cross-entropy, computed in chunks of tokens. With neighbours, each
    position's softmax also holds the batch's targets (`negatives`: default `targets`' distinct ids, the k most
    frequent when there are more; pass an empty tensor for the neighbours alone). `stream`: the `WeightStream` that
    releases the weight's rows as they are read (memory savers).
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
    subsets, excluded, offsets = None, None, None
    if neighbours is not None:
        subsets = neighbours(targets)
    if neighbours is not None and len(targets):
        if negatives is None:
            negatives = batch_negatives(targets, neighbours.k)
        if len(negatives):
            subsets, excluded = with_batch_negatives(subsets, negatives.to(subsets.device))
        far, far_explicit, log_weight = neighbours.far_sample(targets, negatives)
        if len(far):  # the rest of the vocabulary, estimated by a uniform sample shared by every position
            n, width = subsets.shape
            subsets = torch.cat([subsets, far.to(subsets).expand(n, -1)], dim=1)
            if excluded is None:
                excluded = torch.zeros(n, width, dtype=torch.bool)
            excluded = torch.cat([excluded, far_explicit.to(excluded.device)], dim=1)
            offsets = torch.zeros(subsets.shape[1], dtype=torch.float32, device=hidden.device)
            offsets[width:] = log_weight
    if chunk_tokens is None:
        width = weight.shape[0] * 4 if subsets is None else subsets.shape[1] * weight.shape[1] * weight.element_size()
        chunk_tokens = chunk_tokens_for(width)
    return ChunkedCrossEntropy.apply(hidden, weight, bias, targets, subsets, excluded, offsets, chunk_tokens, stream)
