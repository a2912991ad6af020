"""The CPU side of a LoRA step, fused: each RMSNorm and each gated MLP activation compiled once per model class.

The frozen products run on the backend; most of what else a step computes on the CPU is element-wise passes over the
activations. Eager, an RMSNorm is five kernels (upcast, mean of squares, rsqrt, scale, downcast) and a gated
activation two (`act(gate)`, `* up`), forward and backward; `torch.compile` (inductor) makes each one. The frozen
products, attention (SDPA, already fused) and the adapters are untouched, and so are the numerics up to the
order of the fused kernels' sums.

One compiled function serves every instance of a class (the module is an argument, its parameters graph inputs), so
a model compiles each graph once, not once per layer. Shapes: the first batch's compiles static kernels; the first
batch of another length recompiles them once with the lengths symbolic (torch's automatic dynamic shapes), and
later lengths reuse those: padded batches of varying length do not recompile every step.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

GATED_MLP = ("gate_proj", "up_proj", "down_proj", "act_fn")


@functools.cache
def _compiled(forward):
    """`forward` (a class's unbound forward) compiled once for all its instances."""
    return torch.compile(forward, dynamic=None)


def _gated(act: nn.Module, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return act(gate) * up


def _gated_mlp_forward(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A llama-style gated MLP, `down(act(gate(x)) * up(x))`, with `act(.) * up` as one compiled kernel."""
    return mlp.down_proj(_compiled(_gated)(mlp.act_fn, mlp.gate_proj(x), mlp.up_proj(x)))


def _is_rms_norm(module: nn.Module) -> bool:
    return type(module).__name__.endswith("RMSNorm")


def _is_gated_mlp(module: nn.Module) -> bool:
    return type(module).__name__.endswith("MLP") and all(hasattr(module, name) for name in GATED_MLP)


def compile_seconds() -> float:
    """Seconds this process has spent in torch.compile so far (Dynamo tracing and inductor, forward and backward)."""
    return float(torch._dynamo.utils.calculate_time_spent().get("total_wall_time", 0.0))


class FusedCpuOps:
    """The RMSNorms and gated MLPs of `model` running their compiled forms (see the module docstring).

    Each fused module gets a `forward` instance attribute (nothing else changes; `restore` removes them). Modules whose
    forward was already replaced are left alone. `modules` counts what was fused; `compile_seconds()` is the
    process's compile time since fusing (paid on the first step of each shape bucket)."""

    def __init__(self, model: nn.Module):
        self._fused, self._start = [], compile_seconds()
        for module in model.modules():
            if "forward" in vars(module):
                continue
            if _is_rms_norm(module):
                module.forward = functools.partial(_compiled(type(module).forward), module)
            elif _is_gated_mlp(module):
                module.forward = functools.partial(_gated_mlp_forward, module)
            else:
                continue
            self._fused.append(module)

    @property
    def modules(self) -> int:
        return len(self._fused)

    def compile_seconds(self) -> float:
        return compile_seconds() - self._start

    def restore(self) -> None:
        """Give every fused module its own forward back."""
        for module in self._fused:
            vars(module).pop("forward", None)
        self._fused = []


def fuse_cpu_ops(model: nn.Module) -> FusedCpuOps:
    """Fuse the element-wise CPU work of `model`'s training step (RMSNorms, gated MLP activations) with torch.compile;
    returns the handle (`.modules`, `.compile_seconds()`, `.restore()`). For a `PactConfig` model trained without
    `PactTrainer` (which does this with `pact_fuse_cpu_ops`): `optimum_pact.fuse_cpu_ops(peft_model)`."""
    return FusedCpuOps(model)


__all__ = ["FusedCpuOps", "compile_seconds", "fuse_cpu_ops"]
