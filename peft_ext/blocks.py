"""The decoder blocks of a transformers model: which linears they hold, which block a module is in, and the speed
setting's choices over them (adapt the top blocks, quantize the linears left without an adapter).

Layer names are relative to the transformers model (`model.layers.3.mlp.down_proj`), the same whether or not the
model is wrapped by `get_peft_model`, and the same names peft passes to dispatchers as `target_name`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from torch import nn

from optimum_pact.backends import Backend, get_backend
from optimum_pact.dataflow import FrozenLinear
from optimum_pact.nvfp4 import BLOCK_SIZE

DEFAULT_TOP_FRACTION = 0.5  # speed setting: adapt the top half of the blocks (why: default_top_blocks)


def block_index(name: str) -> int | None:
    """The decoder block a module name belongs to: its first all-digit path component (`model.layers.3.mlp` -> 3).

    That is the `nn.ModuleList` index in every Hugging Face decoder (`model.layers.N`, `transformer.h.N`,
    `gpt_neox.layers.N`, `model.decoder.layers.N`); None for modules outside the blocks (lm_head, embeddings).
    """
    for part in name.split("."):
        if part.isdigit():
            return int(part)
    return None


def _unwrap(model: nn.Module) -> nn.Module:
    """The transformers model under a `PeftModel` (or peft's `LoraModel`); `model` itself otherwise."""
    from peft import PeftModel
    from peft.tuners.tuners_utils import BaseTuner

    if isinstance(model, PeftModel):
        model = model.get_base_model()
    if isinstance(model, BaseTuner):
        model = model.model
    return model


def block_linears(model: nn.Module) -> dict[str, nn.Module]:
    """Every linear-like module inside the decoder blocks (anything with in/out_features), by name; a peft LoRA
    layer counts as its base layer, under the LoRA layer's name; the adapters' own linears are left out."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    found: dict[str, nn.Module] = {}
    inside_tuner: list[str] = []
    for name, module in _unwrap(model).named_modules():
        if any(name.startswith(prefix) for prefix in inside_tuner):
            continue  # base_layer, lora_A, lora_B, ... of a tuner layer already seen
        if isinstance(module, BaseTunerLayer):
            inside_tuner.append(name + ".")
            module = module.get_base_layer()
        if block_index(name) is not None and hasattr(module, "in_features") and hasattr(module, "out_features"):
            found[name] = module
    return found


def decoder_linears(model: nn.Module) -> dict[str, nn.Linear]:
    """The `nn.Linear` layers inside decoder blocks, by name (`model.layers.3.mlp.down_proj`), in module order.

    A peft LoRA layer counts as its `base_layer` (under the LoRA layer's own name); the adapters' own linears
    (`lora_A`, `lora_B`) and everything outside the blocks (lm_head, embeddings) are left out. Raises ValueError
    when there is none, saying what was looked for and what was found instead.
    """
    every = block_linears(model)
    found = {name: module for name, module in every.items() if type(module) is nn.Linear}
    if not found:
        other = sorted({type(module).__name__ for module in every.values()})
        seen = (
            f" Found only {', '.join(other)}, whose weight is already quantized or not a plain tensor."
            if other
            else ""
        )
        raise ValueError(
            f"{type(model).__name__} has no linear layer the AQLoRA ranking understands: it looks for torch.nn.Linear "
            "modules (or peft LoRA layers wrapping one) inside numbered decoder blocks such as "
            f"`model.layers.<i>.mlp.down_proj`.{seen} Rank the full-precision model before quantizing it "
            "(before get_peft_model with PactConfig, or load it without a quantization_config)."
        )
    return found


def linear_shapes(model: nn.Module, names: Sequence[str] = ()) -> dict[str, tuple[int, int]]:
    """(out_features, in_features) of every decoder linear, quantized or not; `names` not among them are a
    ValueError (they name layers to protect)."""
    shapes = {name: (m.out_features, m.in_features) for name, m in block_linears(model).items()}
    unknown = sorted(set(names) - set(shapes))
    if unknown:
        raise ValueError(f"protected names that are not decoder linears of this model: {unknown[:5]}.")
    return shapes


def decoder_blocks(model: nn.Module) -> nn.ModuleList:
    """The ModuleList holding the decoder blocks: the first one not inside a numbered block (`model.layers`).

    Found by structure, not by linear type, so it also works once the linears are quantized (`FrozenLinear`).
    """
    for name, module in _unwrap(model).named_modules():
        if isinstance(module, nn.ModuleList) and len(module) and block_index(name) is None:
            return module
    decoder_linears(model)  # raises the clear error when there is nothing to rank
    raise ValueError(f"{type(model).__name__} has no nn.ModuleList of decoder blocks.")


def num_blocks(model: nn.Module) -> int:
    """How many decoder blocks the model has (the length of its block ModuleList)."""
    return len(decoder_blocks(model))


def lowest_trainable_block(model: nn.Module) -> int | None:
    """The lowest decoder block holding a trainable parameter (after get_peft_model: the lowest adapted block)."""
    found = [block_index(name) for name, p in _unwrap(model).named_parameters() if p.requires_grad]
    found = [i for i in found if i is not None]
    return min(found) if found else None


def default_top_blocks(n_blocks: int) -> int:
    """The speed setting's default `adapt_top_blocks`: the top half of the blocks, rounded up (at least one).

    Measured on SmolLM2-135M (30 blocks; bf16 LoRA r=16 on the top k blocks, backward stopped below, batch 4 x 128,
    medians of 5 interleaved rounds on a shared 2-core CPU, so +/- ~30%): a step took 0.28x (k=4 or 8), 0.48x
    (k=15) and 0.50x (k=23) the time of adapting all 30 blocks. The backward pass through the frozen base costs
    several times the forward here, so the cut pays about in proportion to the depth it removes. Half already
    halves the step (far beyond issue 5's +15% speed target) while half of the layers keep adapters; going to a
    quarter buys more speed than the target needs at a larger quality risk. The quality cost per depth could not be
    measured on the shared machine: check it with `benchmarks/aqlora_accuracy.py --adapt-top-blocks N`.
    """
    return max(1, math.ceil(n_blocks * DEFAULT_TOP_FRACTION))


def speed_targets(model: nn.Module, adapt_top_blocks: int | None = None) -> list[str]:
    """Names of the decoder linears in the top `adapt_top_blocks` blocks (default: `default_top_blocks`)."""
    n = num_blocks(model)
    if adapt_top_blocks is None:
        adapt_top_blocks = default_top_blocks(n)
    if isinstance(adapt_top_blocks, bool) or not isinstance(adapt_top_blocks, int) or not 1 <= adapt_top_blocks <= n:
        raise ValueError(
            f"adapt_top_blocks={adapt_top_blocks!r} does not fit this model, which has {n} decoder blocks: use an "
            f"integer from 1 to {n} (or None for the default, {default_top_blocks(n)})."
        )
    return [name for name in decoder_linears(model) if block_index(name) >= n - adapt_top_blocks]


def quantize_unadapted(model: nn.Module, protected: Sequence[str] = (), backend: Backend | None = None) -> list[str]:
    """Replace every decoder `nn.Linear` that carries no adapter and is not `protected` by an NVFP4 `FrozenLinear`.

    The speed setting adapts only the top blocks, so peft never dispatches the linears below them: without this they
    would stay 16-bit (more memory, and faster than the QLoRA baseline for the wrong reason). Every new layer uses
    `backend`, the model's one `Backend` instance (None: a new torch backend). Layers whose in_features is not a
    multiple of 16 stay as they are. Returns the names replaced.
    """
    from peft.tuners.tuners_utils import BaseTunerLayer

    backend = get_backend("torch") if backend is None else backend
    inner = _unwrap(model)
    adapted = {name for name, module in inner.named_modules() if isinstance(module, BaseTunerLayer)}
    keep = set(protected) | adapted
    replaced = []
    for name, linear in decoder_linears(model).items():
        if name in keep or linear.in_features % BLOCK_SIZE:
            continue
        parent, _, child = name.rpartition(".")
        setattr(inner.get_submodule(parent), child, FrozenLinear.from_linear(linear, backend=backend))
        replaced.append(name)
    return replaced
