"""Forward-only training: MeZO (Malladi et al. 2023), zeroth-order SGD on the trainable (adapter) parameters.

Each step draws z ~ N(0, I) from a per-step seed, measures the loss at theta + eps z and theta - eps z (two forward
passes, no autograd graph, so memory stays at inference level), and moves theta by -lr * (L+ - L-) / (2 eps) * z.
z is regenerated from the seed instead of stored, as in the paper, so the only extra memory is one parameter-sized
noise tensor at a time.
"""

from __future__ import annotations

import time

import torch


class MeZO:
    def __init__(self, params, lr: float = 1e-4, eps: float = 1e-3, seed: int = 0):
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise ValueError("MeZO needs trainable parameters (the adapter's); none require grad")
        self.lr, self.eps, self.seed, self.steps = lr, eps, seed, 0

    def _perturb(self, step_seed: int, scale: float) -> None:
        gen = torch.Generator().manual_seed(step_seed)
        for p in self.params:
            z = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            p.add_(z.to(p.dtype), alpha=scale)

    @torch.no_grad()
    def step(self, loss_fn) -> float:
        """One zeroth-order step; `loss_fn()` returns the loss of the current parameters. Returns the mean loss."""
        step_seed = self.seed * 1_000_003 + self.steps
        self._perturb(step_seed, self.eps)
        plus = float(loss_fn())
        self._perturb(step_seed, -2 * self.eps)
        minus = float(loss_fn())
        self._perturb(step_seed, self.eps)  # back to theta
        grad = (plus - minus) / (2 * self.eps)
        self._perturb(step_seed, -self.lr * grad)
        self.steps += 1
        return (plus + minus) / 2


def train_mezo(model, batches, seconds: float, lr: float = 1e-4, eps: float = 1e-3, seed: int = 0) -> dict:
    """Run MeZO over `batches` (cycled) until `seconds` of wall-clock have passed; returns losses and the count."""
    optimizer = MeZO(model.parameters(), lr=lr, eps=eps, seed=seed)
    losses, start = [], time.perf_counter()
    while time.perf_counter() - start < seconds:
        batch = batches[optimizer.steps % len(batches)]
        losses.append(optimizer.step(lambda batch=batch: model(**batch).loss))
    return {"steps": optimizer.steps, "losses": losses, "seconds": time.perf_counter() - start}
