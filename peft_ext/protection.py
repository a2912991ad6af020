"""AQLoRA layer protection: rank decoder linears by 4-bit reconstruction error, keep the worst few 16-bit.

Everything here is a pure function over an ordinary (unquantized, possibly peft-wrapped) transformers model:

* `rank_layers` / `choose_protected`: one CPU pass computing ||W - deq(q(W))||_F / ||W||_F per decoder linear, for
  NF4 (bitsandbytes' codebook, 64-element blocks, fp32 absmax, no double quant) or NVFP4 (PACT's base format). No
  data, no search; the list depends on the weights alone and ties are broken by name.
* `speed_targets` / `stop_backward_below`: the "speed" setting adapts only the top blocks, and the backward pass
  really stops below them.
* `random_protected` / `matched_random_protected` / `protection_premium_mib`: the count-matched and the
  memory-matched random controls, and the memory cost of protection.

Layer names are relative to the transformers model (`model.layers.3.mlp.down_proj`), the same whether or not the
model is wrapped by `get_peft_model`, and the same names peft passes to dispatchers as `target_name`.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

import torch
from torch import nn

from optimum_pact.nvfp4 import BLOCK_SIZE, F4_E2M1_MAX, F8E4M3_MAX
from optimum_pact.nvfp4.format import E4M3_TINY

RANK_BY = ("nf4", "nvfp4")
NF4_BLOCK_SIZE = 64  # bitsandbytes' default blocksize for quantize_4bit / Linear4bit
# bitsandbytes' NF4 codebook (QLoRA paper, Appendix E), in code order; codes are sorted ascending.
NF4_VALUES = (
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
)
NVFP4_BITS_PER_WEIGHT = 4.5  # 4-bit element + one 8-bit E4M3 scale per 16 elements (+ 4 bytes per tensor)
CHUNK_ELEMENTS = 1 << 18  # elements per chunk: every temporary (~1 MB) stays in L2, memory stays flat


# ----------------------------------------------------------------------------------------------- error metrics


class _NF4Table:
    """Exact NF4 rounding without a binary search: a uniform table over [-1, 1] whose bins hold at most one midpoint.

    bitsandbytes rounds `x / absmax` to the code with `bucketize(x, midpoints)` (a tie goes to the lower code). With
    4096 bins every midpoint lies > 2e-5 from a bin edge (checked here), so the bin `x` falls in, even one float
    rounding off, tells the two candidate codes, and one comparison with that bin's midpoint picks the right one.
    1.8x faster than `torch.bucketize` on CPU; bit-exact (tests/test_protection.py).
    """

    bins = 1 << 12

    def __init__(self):
        code = torch.tensor(NF4_VALUES, dtype=torch.float32)
        mids = (code[:-1] + code[1:]) / 2
        edges = torch.arange(self.bins + 1, dtype=torch.float64) * (2.0 / self.bins) - 1
        home = torch.floor((mids.double() + 1) * (self.bins / 2)).long()
        if (mids.double()[:, None] - edges).abs().min() < 1e-5 or len(set(home.tolist())) != len(mids):
            raise AssertionError("NF4 table: a midpoint sits on a bin edge or two share a bin; change `bins`.")
        lower = torch.bucketize(edges[:-1].float(), mids)  # the code at each bin's start
        self.mids, self.code = mids, code
        self.mid = torch.full((self.bins,), float("inf"))
        self.mid[home] = mids
        self.low, self.high = code[lower], code[(lower + 1).clamp(max=len(code) - 1)]

    def round(self, scaled: torch.Tensor) -> torch.Tensor:
        """NF4 value of each element of `scaled` (fp32 in [-1, 1])."""
        b = scaled.add(1).mul_(self.bins / 2).to(torch.int32).clamp_(0, self.bins - 1).long()
        return torch.where(scaled > self.mid[b], self.high[b], self.low[b])


_NF4 = _NF4Table()


def _nf4_roundtrip(blocks: torch.Tensor) -> torch.Tensor:
    """deq(q(x)) for fp32 rows of 64 elements, with bitsandbytes' arithmetic (default CPU `quantize_4bit`)."""
    absmax = blocks.abs().amax(dim=-1, keepdim=True)
    scaled = torch.clamp(blocks * (1.0 / absmax.clamp(min=1e-38)), -1, 1)
    return _NF4.round(scaled).mul_(absmax)


def nf4_dequantized(weight: torch.Tensor) -> torch.Tensor:
    """The weight bitsandbytes' NF4 (blocksize 64, fp32 absmax) would reconstruct, as fp32 of the same shape.

    bitsandbytes blocks the row-major flattened tensor; a last partial block is padded with zeros here, which
    changes neither its absmax nor any reconstructed value.
    """
    flat = weight.detach().reshape(-1).float()
    pad = -flat.numel() % NF4_BLOCK_SIZE
    blocks = torch.nn.functional.pad(flat, (0, pad)).reshape(-1, NF4_BLOCK_SIZE)
    return _nf4_roundtrip(blocks).reshape(-1)[: flat.numel()].reshape(weight.shape)


def _nvfp4_scale_2(weight: torch.Tensor) -> torch.Tensor:
    amax = weight.detach().abs().amax().float()
    return amax / (F8E4M3_MAX * F4_E2M1_MAX) if amax > 0 else torch.ones((), dtype=torch.float32)


def _e2m1_round(x: torch.Tensor) -> torch.Tensor:
    """E2M1 value of each element of `x` (fp32 in [-6, 6]), ties to even: `E2M1[float_to_e2m1(x)]` bit for bit.

    E2M1's grid has step 0.5 below 2, 1 below 4 and 2 up to 6; dividing by a power-of-two step is exact and
    `torch.round` rounds half to even, which is the even code. Twice as fast as the code path; tested against it.
    """
    mag = x.abs()
    step = (mag >= 2).float().add_((mag >= 4).float()).exp2_().mul_(0.5)
    return torch.round(mag / step).mul_(step).copysign_(x)


def _nvfp4_roundtrip(rows: torch.Tensor, scale_2: torch.Tensor) -> torch.Tensor:
    """dequantize_reference(quantize(W)) for a slice of W's rows, given W's per-tensor scale: same ops, same bits."""
    n, k = rows.shape
    w = rows.float().reshape(n, k // BLOCK_SIZE, BLOCK_SIZE)
    scale = (w.abs().amax(dim=-1) / F4_E2M1_MAX / scale_2).clamp(min=E4M3_TINY, max=F8E4M3_MAX)
    scale = scale.to(torch.float8_e4m3fn).float()
    scaled = (w * ((1.0 / scale_2) / scale).unsqueeze(-1)).clamp(-F4_E2M1_MAX, F4_E2M1_MAX)
    return ((_e2m1_round(scaled) * scale.unsqueeze(-1)) * scale_2).reshape(n, k)


def nvfp4_dequantized(weight: torch.Tensor) -> torch.Tensor:
    """`dequantize_reference(quantize(weight))` as fp32, computed without packing (bit-identical; tested)."""
    return _nvfp4_roundtrip(weight.detach(), _nvfp4_scale_2(weight))


def reconstruction_error(weight: torch.Tensor, rank_by: str = "nvfp4") -> float:
    """||W - deq(q(W))||_F / ||W||_F for NF4 (`rank_by="nf4"`) or NVFP4 (`"nvfp4"`); 0.0 for an all-zero weight.

    Works through W in chunks of rows (about `CHUNK_ELEMENTS` at a time) so a 0.5B model ranks in seconds and
    never holds more than a few copies of one chunk; sums are accumulated in float64.
    """
    check_rank_by(rank_by)
    if weight.dim() != 2 or not weight.dtype.is_floating_point:
        raise ValueError(
            f"reconstruction_error needs a 2-D floating weight; got {weight.dtype} {tuple(weight.shape)}."
        )
    if rank_by == "nvfp4" and weight.shape[1] % BLOCK_SIZE:
        raise ValueError(f"NVFP4 needs in_features to be a multiple of {BLOCK_SIZE}; got shape {tuple(weight.shape)}.")
    w, scale_2 = weight.detach(), None
    if rank_by == "nf4":  # bitsandbytes blocks the flattened tensor: chunk whole 64-element blocks (zero-padded)
        flat = w.reshape(-1)
        w = torch.nn.functional.pad(flat, (0, -flat.numel() % NF4_BLOCK_SIZE)).reshape(-1, NF4_BLOCK_SIZE)
    else:
        scale_2 = _nvfp4_scale_2(w)
    rows = max(1, CHUNK_ELEMENTS // w.shape[1])
    err = ref = 0.0
    for start in range(0, w.shape[0], rows):
        chunk = w[start : start + rows].float()
        recon = _nf4_roundtrip(chunk) if scale_2 is None else _nvfp4_roundtrip(chunk, scale_2)
        err += torch.sum((chunk - recon).double().square()).item()
        ref += torch.sum(chunk.double().square()).item()
    return math.sqrt(err / ref) if ref > 0 else 0.0


def check_rank_by(rank_by: str, option: str = "rank_by") -> None:
    """One of `RANK_BY`, else a clear error naming `option`."""
    if rank_by not in RANK_BY:
        raise ValueError(f"{option}={rank_by!r} is not a known format; choose one of {', '.join(RANK_BY)}.")


# ---------------------------------------------------------------------------------------------- model structure


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


def _block_linears(model: nn.Module) -> dict[str, nn.Module]:
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
    every = _block_linears(model)
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


def _shapes(model: nn.Module, names: Sequence[str]) -> dict[str, tuple[int, int]]:
    """(out_features, in_features) of every decoder linear, quantized or not; unknown `names` are a ValueError."""
    shapes = {name: (m.out_features, m.in_features) for name, m in _block_linears(model).items()}
    unknown = sorted(set(names) - set(shapes))
    if unknown:
        raise ValueError(f"protected names that are not decoder linears of this model: {unknown[:5]}.")
    return shapes


def _blocks(model: nn.Module) -> nn.ModuleList:
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
    return len(_blocks(model))


# ------------------------------------------------------------------------------------------ ranking, protection


def rank_layers(model: nn.Module, rank_by: str = "nvfp4") -> list[tuple[str, float]]:
    """(name, relative reconstruction error) for every decoder linear, largest error first, ties by name."""
    check_rank_by(rank_by)
    errors = [(name, reconstruction_error(layer.weight, rank_by)) for name, layer in decoder_linears(model).items()]
    return sorted(errors, key=lambda item: (-item[1], item[0]))


def check_protect_fraction(protect_fraction: float, option: str = "protect_fraction") -> None:
    """A fraction in [0, 1], else a clear error naming `option` (e.g. "PactConfig.protect_fraction")."""
    if isinstance(protect_fraction, bool) or not isinstance(protect_fraction, (int, float)):
        raise TypeError(f"{option} must be a number in [0, 1]; got {protect_fraction!r}.")
    if not 0.0 <= protect_fraction <= 1.0:
        raise ValueError(
            f"{option}={protect_fraction!r} is outside the valid range [0, 1]: it is the fraction of decoder linears "
            "kept 16-bit (e.g. 0.2 keeps the worst fifth); 0 protects none."
        )


def _protect_count(protect_fraction: float, n: int) -> int:
    check_protect_fraction(protect_fraction)
    return math.floor(protect_fraction * n + 0.5)  # round half up: 0.5 * 5 layers protects 3, not Python's 2


def choose_protected(
    model_or_ranking: nn.Module | Sequence[tuple[str, float]], protect_fraction: float, rank_by: str = "nvfp4"
) -> list[str]:
    """The `round(protect_fraction * n)` decoder linears with the largest reconstruction error, worst first.

    Pass a model (ranked here with `rank_by`) or a ranking from `rank_layers` (then `rank_by` is unused). The result
    depends only on the weights: ties are broken by name.
    """
    if isinstance(model_or_ranking, nn.Module):
        _protect_count(protect_fraction, 1)  # fail before the ranking pass
        ranking = rank_layers(model_or_ranking, rank_by)
    else:
        ranking = sorted(model_or_ranking, key=lambda item: (-item[1], item[0]))
    return [name for name, _ in ranking[: _protect_count(protect_fraction, len(ranking))]]


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
    shapes = _shapes(model, protected)
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
    shapes = _shapes(model, protected)
    total = 0.0
    for name in set(protected):
        numel = shapes[name][0] * shapes[name][1]
        total += 2 * numel - (numel * NVFP4_BITS_PER_WEIGHT / 8 + 4)  # bf16 vs packed codes + E4M3 + fp32 scales
    return total / 2**20


# ----------------------------------------------------------------------------------------------- speed setting

DEFAULT_TOP_FRACTION = 0.5  # speed setting: adapt the top half of the blocks (why: default_top_blocks)


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


def quantize_unadapted(
    model: nn.Module, protected: Sequence[str] = (), backend="torch", tile_size: int | None = None
) -> list[str]:
    """Replace every decoder `nn.Linear` that carries no adapter and is not `protected` by an NVFP4 `FrozenLinear`.

    The speed setting adapts only the top blocks, so peft never dispatches the linears below them: without this they
    would stay 16-bit (more memory, and faster than the QLoRA baseline for the wrong reason). Layers whose
    in_features is not a multiple of 16 stay as they are. Returns the names replaced.
    """
    from peft.tuners.tuners_utils import BaseTunerLayer

    from optimum_pact.dataflow import FrozenLinear

    inner = _unwrap(model)
    adapted = {name for name, module in inner.named_modules() if isinstance(module, BaseTunerLayer)}
    keep = set(protected) | adapted
    replaced = []
    for name, linear in decoder_linears(model).items():
        if name in keep or linear.in_features % BLOCK_SIZE:
            continue
        parent, _, child = name.rpartition(".")
        setattr(
            inner.get_submodule(parent), child, FrozenLinear.from_linear(linear, backend=backend, tile_size=tile_size)
        )
        replaced.append(name)
    return replaced


def lowest_trainable_block(model: nn.Module) -> int | None:
    """The lowest decoder block holding a trainable parameter (after get_peft_model: the lowest adapted block)."""
    found = [block_index(name) for name, p in _unwrap(model).named_parameters() if p.requires_grad]
    found = [i for i in found if i is not None]
    return min(found) if found else None


class BackwardStop:
    """The hooks `stop_backward_below` installed; `remove()` takes them out again."""

    def __init__(self, handles: list):
        self.handles = handles

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


# Names of the forward hooks that make the input embeddings' output require grad: transformers'
# `enable_input_require_grads` (kept in `_require_grads_hooks`, removable through `disable_input_require_grads`) and
# peft's fallback copies in `prepare_model_for_kbit_training` / `PeftModel` (registered without a handle).
_REQUIRE_GRAD_HOOK_NAMES = ("make_inputs_require_grads", "make_inputs_require_grad")


def _remove_input_require_grad_hooks(model: nn.Module) -> None:
    """Remove the embedding hooks that force `requires_grad` on the embeddings' output."""
    from transformers import PreTrainedModel

    inner = _unwrap(model)
    for module in inner.modules():
        if isinstance(module, PreTrainedModel):
            module.disable_input_require_grads()
    embeddings = inner.get_input_embeddings() if hasattr(inner, "get_input_embeddings") else None
    if embeddings is None:
        return
    # peft's fallback registers without keeping a handle: the one private structure touched here, emptied the way
    # torch's RemovableHandle.remove does (tests/test_protection.py fails loudly if torch changes it).
    for key, hook in list(embeddings._forward_hooks.items()):
        if getattr(hook, "__name__", "") in _REQUIRE_GRAD_HOOK_NAMES:
            for hooks in (embeddings._forward_hooks, embeddings._forward_hooks_with_kwargs):
                hooks.pop(key, None)
            embeddings._forward_hooks_always_called.pop(key, None)


def _first_tensor(args: tuple, kwargs: dict) -> tuple[tuple, dict, torch.Tensor | None]:
    if args and isinstance(args[0], torch.Tensor):
        return args, kwargs, args[0]
    return args, kwargs, kwargs.get("hidden_states")


def _replace_hidden(args: tuple, kwargs: dict, hidden: torch.Tensor) -> tuple[tuple, dict]:
    if args and isinstance(args[0], torch.Tensor):
        return (hidden, *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": hidden}


def _uses_reentrant_checkpointing(block: nn.Module) -> bool:
    if not (getattr(block, "gradient_checkpointing", False) and block.training and torch.is_grad_enabled()):
        return False
    func = getattr(block, "_gradient_checkpointing_func", None)
    return bool(getattr(func, "keywords", {}).get("use_reentrant", True))


def stop_backward_below(model: nn.Module, lowest_block: int) -> BackwardStop:
    """Make sure no gradient is computed in blocks below `lowest_block` (the lowest adapted block), nor embeddings.

    Call it after `get_peft_model` (and after `prepare_model_for_kbit_training`, if used); it keeps working when
    gradient checkpointing is enabled later (e.g. by the Trainer at the start of training). It

    1. refuses (ValueError) if any parameter below `lowest_block` or in the input embeddings is trainable: the
       speed setting would silently not train it;
    2. removes the input-embedding forward hooks that transformers' `enable_input_require_grads` (called by
       `activation_checkpointing_enable`, peft's `prepare_model_for_kbit_training` and `PeftModel` when
       checkpointing is on) and peft's fallback copies install to force `requires_grad` on the embeddings' output;
    3. detaches the hidden states entering block 0 (a forward pre-hook), so even a hook re-installed later (the
       Trainer enables checkpointing after this call) cannot make the lower blocks build an autograd graph: no
       backward op, no saved activation, no recomputation below `lowest_block`;
    4. under reentrant checkpointing only, marks the hidden states entering `lowest_block` as requiring grad: the
       reentrant `checkpoint` returns a graph-less output when no input requires grad, which would silently leave
       the adapters of that block untrained. Non-reentrant checkpointing (transformers' default) needs nothing.

    Calling it again replaces the previous call's hooks. Returns a `BackwardStop` whose `remove()` undoes 3-4.
    """
    blocks = _blocks(model)
    if isinstance(lowest_block, bool) or not isinstance(lowest_block, int) or not 0 <= lowest_block < len(blocks):
        raise ValueError(f"lowest_block={lowest_block!r} must be an integer from 0 to {len(blocks) - 1}.")
    inner = _unwrap(model)
    below = [
        name
        for name, p in inner.named_parameters()
        if p.requires_grad and block_index(name) is not None and block_index(name) < lowest_block
    ]
    embeddings = inner.get_input_embeddings() if hasattr(inner, "get_input_embeddings") else None
    output = inner.get_output_embeddings() if hasattr(inner, "get_output_embeddings") else None
    tied = {id(p) for p in output.parameters()} if output is not None else set()
    if embeddings is not None:  # a tied lm_head trains through the output side, which stays above the cut
        below += [
            f"input embeddings.{n}" for n, p in embeddings.named_parameters() if p.requires_grad and id(p) not in tied
        ]
    if below:
        raise ValueError(
            f"stop_backward_below({lowest_block}) found trainable parameters below block {lowest_block}: "
            f"{below[:5]}. The speed setting cannot train them: adapt only the top blocks (speed_targets) or use "
            "adapt='quality'."
        )
    _remove_input_require_grad_hooks(model)

    def cut(module, args, kwargs):
        args, kwargs, hidden = _first_tensor(args, kwargs)
        if hidden is None or not hidden.requires_grad:
            return None
        return _replace_hidden(args, kwargs, hidden.detach())

    def resume(module, args, kwargs):
        args, kwargs, hidden = _first_tensor(args, kwargs)
        if hidden is None or hidden.requires_grad or not _uses_reentrant_checkpointing(module):
            return None
        return _replace_hidden(args, kwargs, hidden.detach().requires_grad_(True))

    previous = getattr(blocks, "_pact_backward_stop", None)
    if previous is not None:  # called again (e.g. at on_train_begin): replace, never stack
        previous.remove()
    handles = []
    if lowest_block > 0:
        handles.append(blocks[0].register_forward_pre_hook(cut, with_kwargs=True))
    handles.append(blocks[lowest_block].register_forward_pre_hook(resume, with_kwargs=True))
    blocks._pact_backward_stop = BackwardStop(handles)
    return blocks._pact_backward_stop
