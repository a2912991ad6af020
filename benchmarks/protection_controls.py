"""The AQLoRA benchmarks' controls for error-ranked protection: count-matched and memory-matched random protection
lists, and the memory cost of protecting layers."""

from __future__ import annotations

import random
from collections.abc import Sequence

from torch import nn

from peft_ext.blocks import linear_shapes

NVFP4_BITS_PER_WEIGHT = 4.5  # 4-bit element + one 8-bit E4M3 scale per 16 elements (+ 4 bytes per tensor)


def random_protected(names: Sequence[str], count: int, seed: int = 0) -> list[str]:
    """`count` of `names` drawn uniformly with `seed` (a count-matched random control), in name order."""
    pool = sorted(set(names))
    if isinstance(count, bool) or not isinstance(count, int) or not 0 <= count <= len(pool):
        raise ValueError(f"count={count!r} must be an integer in [0, {len(pool)}] (the number of names given).")
    return sorted(random.Random(seed).sample(pool, count))


def matched_random_protected(model: nn.Module, protected: Sequence[str], seed: int = 0) -> list[str]:
    """A random control matched in count AND memory: as many layers of each weight shape as `protected` has.

    Error ranking favours some shapes (on SmolLM2 and Qwen2.5-0.5B mostly the small attention projections); drawing
    the same number of layers uniformly within each shape class gives exactly the same memory premium. Name order.
    """
    shapes = linear_shapes(model, protected)
    by_shape: dict[tuple, list[str]] = {}
    for name, shape in shapes.items():
        by_shape.setdefault(shape, []).append(name)
    rng, chosen = random.Random(seed), []
    for shape in sorted(by_shape):
        count = sum(shapes[name] == shape for name in set(protected))
        chosen += rng.sample(sorted(by_shape[shape]), count)
    return sorted(chosen)


def protection_premium_mib(model: nn.Module, protected: Sequence[str]) -> float:
    """Extra memory of keeping `protected` layers 16-bit instead of NVFP4, in MiB (weights only; biases are equal).

    Needs only the layer shapes, so it works before or after the model is quantized.
    """
    shapes = linear_shapes(model, protected)
    total = 0.0
    for name in set(protected):
        numel = shapes[name][0] * shapes[name][1]
        total += 2 * numel - (numel * NVFP4_BITS_PER_WEIGHT / 8 + 4)  # bf16 vs packed codes + E4M3 + fp32 scales
    return total / 2**20
