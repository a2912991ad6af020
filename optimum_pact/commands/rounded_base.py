"""The person's own NVFP4 base: each frozen linear rounded by GPTQ on the person's training items.

Rounding each weight to its nearest NVFP4 value is what costs the NVFP4 base its accuracy: on the main job's notes,
stock peft LoRA + Trainer on the nearest-rounded weights scored 81.7 / 88.3 / 81.7% (seeds 0-2) against 90.0 / 93.3
/ 90.0% on the full-precision base. GPTQ (`optimum_pact.nvfp4.gptq`) rounds each linear so that what it computes on
the inputs it sees stays close; on the person's training items the same Trainer scored 93.3 / 91.7 / 93.3%, while
GPTQ on text the model sampled itself (no data) gained nothing (seed 0: 81.7%). So the rounding is the person's own,
like the adapter: `pact finetune --rounding gptq` (the main job's default) rounds the base before training and
saves the codes beside the adapter (`pact_base.safetensors`, ModelOpt's NVFP4 tensor names); every use of the
adapter loads them, so what was trained is what runs. `--rounding nearest` trains on the base every adapter
shares (several people's adapters on one base).

The moments GPTQ needs are taken block by block (as GPTQ itself does): the first block's inputs are caught once per
batch, then each block runs on them with hooks on its linears, its linears are rounded and its moments dropped
before the next block runs on its outputs. One forward pass of the items in all, and one block's moments in memory.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from tqdm.auto import tqdm

from ..dataflow import FrozenLinear
from ..nvfp4 import BLOCK_SIZE, NVFP4Tensor
from ..nvfp4.gptq import gptq_quantize_many

BASE_FILE = "pact_base.safetensors"  # in an adapter folder: the codes of the base it was trained on
ROUNDINGS = ("gptq", "nearest")
MAX_ROWS = 256  # training items the moments are taken over, as the merge's calibration takes them
# moments held before the blocks that have them are rounded (together: GPTQ's column loop runs once per group of
# blocks, ~3x faster than block by block on SmolLM2; the moments are most of the memory this takes)
MOMENTS_BUDGET = 64 << 20


class _Caught(Exception):
    """Raised by the hook on the first block once it has its inputs: the rest of the forward pass is not needed."""


@torch.no_grad()
def gptq_base(model: nn.Module, rows: list[list[int]], checkpoint: str | Path, batch_size: int = 16) -> dict:
    """`{linear name: NVFP4Tensor}`: GPTQ of each decoder linear of `model` that is, or will be, NVFP4 (a plain
    `nn.Linear` with in_features a multiple of 16, or an NVFP4 `FrozenLinear`), on the token rows `rows` (the first
    `MAX_ROWS`), block by block. A block whose linears are NVFP4 already (a base loaded packed) runs on their
    full-precision weights read from `checkpoint`'s safetensors, one block at a time: the moments are those of the
    full-precision model either way."""
    from peft_ext.blocks import block_index, block_linears, decoder_blocks

    from .model_folder import original_weights

    every = block_linears(model)
    linears = {name: layer for name, layer in every.items() if _rounded(layer)}
    blocks = decoder_blocks(model)
    caught: list[tuple[tuple, dict, torch.Tensor]] = []  # per batch: the first block's args, kwargs, real positions

    def catch(module, args, kwargs):
        caught.append((args, kwargs, real[0]))
        raise _Caught

    rows = sorted(rows[:MAX_ROWS], key=len)  # batches of like lengths: less padding to run (the sums do not care)
    real = [torch.zeros(0, dtype=torch.bool)]
    handle = blocks[0].register_forward_pre_hook(catch, with_kwargs=True)
    was_training = model.training
    model.eval()
    try:
        for start in range(0, len(rows), batch_size):
            batch = rows[start : start + batch_size]
            width = max(len(ids) for ids in batch)
            mask = torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids in batch])
            real[0] = mask.reshape(-1).bool()
            try:
                ids = torch.tensor([ids + [0] * (width - len(ids)) for ids in batch])
                model(input_ids=ids, attention_mask=mask, use_cache=False)
            except _Caught:
                pass
        handle.remove()
        codes: dict[str, NVFP4Tensor] = {}
        pending: list[tuple[str, torch.Tensor, torch.Tensor]] = []  # (name, weight, moments) not rounded yet
        for i, block in enumerate(tqdm(blocks, desc="rounding the base (GPTQ)", unit="block", leave=False)):
            mine = {name: layer for name, layer in linears.items() if block_index(name) == i}
            here = {name: layer for name, layer in every.items() if block_index(name) == i}
            packed = [name for name, layer in here.items() if isinstance(layer, FrozenLinear)]
            dense = _dense_in(model, here, original_weights(checkpoint, packed) if packed else {})
            sums: dict[str, torch.Tensor] = {}
            owner: dict[str, str] = {}  # a layer's name -> the layer whose input (and sum) it shares
            try:
                for n, (args, kwargs, positions) in enumerate(caught):
                    out = _block_moments(block, dense, args, kwargs, positions, sums, owner)
                    caught[n] = ((out[0] if isinstance(out, tuple) else out, *args[1:]), kwargs, positions)
            finally:
                _put_back(model, here, dense)
            pending += [(name, dense[name].weight, sums[owner.get(name, name)]) for name in mine
                        if owner.get(name, name) in sums]  # fmt: skip
            held = sum(h.numel() * h.element_size() for h in {id(h): h for _, _, h in pending}.values())
            if held >= MOMENTS_BUDGET or i == len(blocks) - 1:  # round the blocks so far together: one column loop
                codes.update(zip([p[0] for p in pending], gptq_quantize_many([(w, h) for _, w, h in pending])))
                pending = []
    finally:
        handle.remove()
        model.train(was_training)
    return codes


def _rounded(layer: nn.Module) -> bool:
    if isinstance(layer, FrozenLinear):
        return layer.precision == "nvfp4"
    return type(layer) is nn.Linear and layer.in_features % BLOCK_SIZE == 0


def _dense_in(model: nn.Module, mine: dict[str, nn.Module], originals: dict[str, torch.Tensor]) -> dict:
    """`mine` as full-precision `nn.Linear`s, swapped in `model`: a plain one as it is, an NVFP4 FrozenLinear as its
    checkpoint weight (`originals`, which a 16-bit one may hold rounded again), in the model's dtype, with its bias."""
    dense = {}
    for name, layer in mine.items():
        if not isinstance(layer, FrozenLinear):
            dense[name] = layer
            continue
        linear = nn.Linear(layer.in_features, layer.out_features, bias=False, device="meta")
        linear.weight = nn.Parameter(originals[name].to(model.dtype), requires_grad=False)
        linear.bias = layer.bias
        model.set_submodule(_path(model, layer), linear)
        dense[name] = linear
    return dense


def _put_back(model: nn.Module, mine: dict[str, nn.Module], dense: dict[str, nn.Module]) -> None:
    for name, layer in mine.items():
        if dense[name] is not layer:
            model.set_submodule(_path(model, dense[name]), layer)


def _path(model: nn.Module, module: nn.Module) -> str:
    return next(path for path, m in model.named_modules() if m is module)


def _block_moments(block, mine, args, kwargs, positions, sums, owner):
    """Run `block` on one batch, adding `x^T x` over the real positions of each of `mine`'s inputs to `sums`
    (`record_moments`; layers sharing an input share a sum, recorded in `owner`)."""
    handles = record_moments(mine, sums, owner, [positions])
    try:
        return block(*args, **kwargs)
    finally:
        for handle in handles:
            handle.remove()


def record_moments(layers: dict[str, nn.Module], sums: dict, shared: dict, real: list[torch.Tensor]) -> list:
    """Forward pre-hooks on `layers` (their handles) that add `x^T x` of each one's input `x` to `sums[name]`, over
    the flattened positions `real[0]` marks (the batch's tokens, not its padding). A layer that reads the tensor the
    layer before it read (q, k and v; gate and up) adds nothing and is entered in `shared` under that layer."""
    last: list = [None, None]  # the input the previous layer read (held, so its memory is not reused) and that layer

    def hook(name: str):
        def record(module, args):
            x = args[0]
            if x is last[0]:
                shared[name] = last[1]
                return
            last[:] = [x, name]
            flat = x.detach().reshape(-1, x.shape[-1])[real[0]].float()
            sums[name] = sums[name].addmm_(flat.T, flat) if name in sums else flat.T @ flat

        return record

    return [layer.register_forward_pre_hook(hook(name)) for name, layer in layers.items()]


def save_codes(folder: Path, codes: dict[str, NVFP4Tensor]) -> None:
    """Write `codes` to `folder/BASE_FILE` under ModelOpt's names (`<linear>.weight`, `.weight_scale`,
    `.weight_scale_2`)."""
    tensors = {}
    for name, q in codes.items():
        tensors[f"{name}.weight"] = q.qdata.contiguous()
        tensors[f"{name}.weight_scale"] = q.scale.contiguous()
        tensors[f"{name}.weight_scale_2"] = q.scale_2.reshape(()).float().contiguous()
    save_file(tensors, str(Path(folder) / BASE_FILE), metadata={"format": "pt", "rounding": "gptq"})


def base_codes_file(folder: str | Path | None) -> Path | None:
    """The adapter folder's `BASE_FILE` (None: the adapter was trained on the shared, nearest-rounded base)."""
    if folder is None:
        return None
    path = Path(folder) / BASE_FILE
    return path if path.is_file() else None


def read_codes(path: Path) -> dict[str, NVFP4Tensor]:
    """The codes saved by `save_codes` in `path`; a damaged file is a ValueError naming it."""
    try:
        tensors = load_file(str(path))
    except Exception as err:  # safetensors raises its own error types
        raise ValueError(f"{path} could not be read ({err}); train the adapter again or restore the file") from err
    names = sorted({key.rsplit(".", 1)[0] for key in tensors if key.endswith(".weight")})
    try:
        return {name: NVFP4Tensor(tensors[f"{name}.weight"], tensors[f"{name}.weight_scale"],
                                  tensors[f"{name}.weight_scale_2"]) for name in names}  # fmt: skip
    except KeyError as err:
        raise ValueError(f"{path} lacks {err.args[0]}; train the adapter again or restore the file") from None


def frozen_linears(model: nn.Module) -> dict[str, tuple[str, FrozenLinear]]:
    """`{linear name: (its module path in model, the FrozenLinear)}`; the name as the base model calls the linear
    (peft's `target_name`: no `base_model.model.` prefix, no `.base_layer` suffix)."""
    out = {}
    for path, module in model.named_modules():
        if isinstance(module, FrozenLinear):
            out[path.removeprefix("base_model.model.").removesuffix(".base_layer")] = (path, module)
    return out


def apply_codes(model: nn.Module, codes: dict[str, NVFP4Tensor]) -> list[str]:
    """Load `codes` into the NVFP4 `FrozenLinear`s of `model` they name (peft-wrapped or not); the names loaded.
    A name with no such layer, or codes of another shape, is a ValueError: the adapter was trained on another base."""
    layers = frozen_linears(model)
    done = []
    for name, q in codes.items():
        entry = layers.get(name)
        if entry is None or entry[1].precision != "nvfp4":
            continue  # held 16-bit here (another adapter's set): its codes are not used
        layer: FrozenLinear = entry[1]
        if tuple(q.shape) != (layer.out_features, layer.in_features) or layer.in_features % BLOCK_SIZE:
            raise ValueError(f"the saved base codes of {name} are {tuple(q.shape)}, the model's layer is "
                             f"{(layer.out_features, layer.in_features)}: load the adapter on the base it was "
                             "trained on")  # fmt: skip
        layer.load_nvfp4(q)
        done.append(name)
    return done


def apply_adapter_codes(model: nn.Module, adapter: str | Path) -> list[str]:
    """`apply_codes` of the base codes saved in the adapter folder `adapter`, if it has them (else nothing)."""
    codes = base_codes_file(adapter)
    return apply_codes(model, read_codes(codes)) if codes is not None else []


__all__ = [
    "BASE_FILE", "MAX_ROWS", "ROUNDINGS", "apply_adapter_codes", "apply_codes", "base_codes_file", "frozen_linears",
    "gptq_base", "read_codes", "record_moments", "save_codes",
]  # fmt: skip
