"""`pact export --format gguf-lora`: a trained adapter as a llama.cpp LoRA GGUF, applied to the base GGUF a phone
already has (`llama-cli -m base.gguf --lora adapter.gguf`, or llama-cpp-python's `Llama(lora_path=...)`).

The file follows llama.cpp's own LoRA GGUF (what its convert_lora_to_gguf.py writes): `general.type = adapter`,
`adapter.type = lora`, `adapter.lora.alpha`, and per adapted weight two float32 tensors `blk.N.attn_q.weight.lora_a`
(numpy shape r x in) and `.lora_b` (out x r). llama.cpp scales each pair by alpha / r, r read off the tensor.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM

from ..errors import NoSpaceError
from ..files import free_bytes, ran_out_of_space, read_json_object
from .model_folder import RUN_AGAIN, check_adapter_folder, resolve_model

# transformers model_type -> llama.cpp architecture
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2"}
# llama.cpp's llama rotates neighbouring pairs of a head's dimensions, HF's Llama its two halves: llama.cpp's HF
# converter reorders the rows of q_proj/k_proj to match, so the rows of lora_B (the output side) move with them.
# Its qwen2 rotates halves like HF: nothing moves.
PERMUTED = {"llama"}
# the modules of block N (model.layers.N.<module>) that llama.cpp names
TENSOR_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
# adapter_config.json options that make an adapter more than plain LoRA (x + scale * B A x on a linear's weight):
# a llama.cpp LoRA GGUF cannot carry them. Each is off when falsy (peft's defaults).
NOT_PLAIN = (
    "use_dora", "lora_bias", "modules_to_save", "trainable_token_indices", "target_parameters", "layer_replication",
    "alora_invocation_tokens", "alpha_pattern", "fan_in_fan_out", "use_qalora", "use_bdlora", "velora_config",
    "monteclora_config", "kasa_config", "arrow_config",
)  # fmt: skip
INSTEAD = "export it with --format merged-bf16 instead, or fine-tune a plain LoRA adapter"


@dataclass
class GGUFAdapter:
    """An adapter in llama.cpp's terms: what `read_adapter` makes of an adapter folder and its base."""

    source: str  # the adapter folder
    base: str  # the model folder its architecture and shapes come from
    architecture: str  # llama.cpp's name
    block_count: int
    embedding_length: int
    alpha: float
    tensors: dict[str, tuple[np.ndarray, np.ndarray]]  # "blk.0.attn_q.weight" -> (A, B), float32, B's rows reordered


def read_adapter(adapter: str | Path, base: str | None = None) -> GGUFAdapter:
    """The LoRA tensors of a PEFT adapter folder under llama.cpp's names, checked against `base`'s config
    (None: the default model)."""
    adapter = check_adapter_folder(adapter)
    weights = adapter / "adapter_model.safetensors"
    if not weights.is_file():
        raise FileNotFoundError(
            f"--adapter {str(adapter)!r} holds no adapter weights (adapter_model.safetensors); pass the adapter "
            "folder of a run"
        )
    config = read_json_object(adapter / "adapter_config.json", "pass the adapter folder of a run")
    _check_plain(config, adapter)
    path = resolve_model(base, adapter)
    base_config = AutoConfig.from_pretrained(path)
    architecture = ARCHITECTURES.get(base_config.model_type)
    if architecture is None:
        raise ValueError(
            f"the base {path} is a {base_config.model_type!r} model, and --format gguf-lora supports "
            f"{', '.join(ARCHITECTURES)} only; export with --format merged-bf16 instead"
        )
    with torch.device("meta"):  # the base's module shapes, without its weights
        shapes = AutoModelForCausalLM.from_config(base_config)

    pairs = _pairs(load_file(weights), weights)
    tensors, alphas = {}, set()
    for module, (a, b) in pairs.items():
        name = _tensor_name(module, adapter)
        try:
            expected = tuple(shapes.get_submodule(module).weight.shape)
        except AttributeError:
            raise ValueError(f"{adapter} adapts {module}, which the base {path} does not have") from None
        if (b.shape[0], a.shape[1]) != expected or a.shape[0] != b.shape[1]:
            raise ValueError(
                f"{adapter}: {module} has LoRA A {tuple(a.shape)} and B {tuple(b.shape)}, which do not fit its "
                f"weight {expected} in the base {path}; pass --model, the base the adapter was trained on"
            )
        rank = a.shape[0]
        if not config.get("rank_pattern") and rank != config.get("r"):
            raise ValueError(
                f"{adapter}: {module} has rank {rank} but adapter_config.json says r={config.get('r')}: the two "
                "files are from different runs; pass the adapter folder of one run"
            )
        a, b = a.float().numpy(), b.float().numpy()
        if architecture in PERMUTED and module.endswith(("q_proj", "k_proj")):
            heads = base_config.num_attention_heads if module.endswith("q_proj") else base_config.num_key_value_heads
            b = _pair_rows(b, heads)
        tensors[name] = (a, b)
        # llama.cpp scales by alpha / r; peft by lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA
        alphas.add(config["lora_alpha"] * (math.sqrt(rank) if config.get("use_rslora") else 1.0))
    if not tensors:
        raise ValueError(f"{weights} holds no LoRA weights; pass the adapter folder of a run")
    if len(alphas) > 1:
        raise ValueError(
            f"{adapter}: use_rslora with several ranks (rank_pattern) needs one alpha per rank, but a llama.cpp "
            f"LoRA GGUF has one alpha for the file; {INSTEAD}"
        )
    return GGUFAdapter(
        source=str(adapter), base=path, architecture=architecture, block_count=base_config.num_hidden_layers,
        embedding_length=base_config.hidden_size, alpha=alphas.pop(), tensors=tensors,
    )  # fmt: skip


def _check_plain(config: dict, adapter: Path) -> None:
    if config.get("peft_type") != "LORA":
        raise ValueError(f"{adapter}: peft_type {config.get('peft_type')!r} is not LORA; {INSTEAD}")
    for option in NOT_PLAIN:
        if config.get(option):
            raise ValueError(
                f"{adapter}/adapter_config.json sets {option}={config[option]!r}, which a llama.cpp LoRA GGUF "
                f"cannot hold (plain LoRA only); {INSTEAD}"
            )
    if config.get("bias", "none") != "none":
        raise ValueError(f"{adapter}/adapter_config.json trains biases (bias={config['bias']!r}); {INSTEAD}")


def _pairs(state: dict[str, torch.Tensor], weights: Path) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{module name: (lora_A, lora_B)} from PEFT's saved keys, base_model.model.<module>.lora_A.weight."""
    found: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in state.items():
        match = re.fullmatch(r"base_model\.model\.(.+)\.(lora_A|lora_B)\.weight", key)
        if match is None:  # e.g. DoRA's magnitude vectors, modules_to_save copies, embedding LoRA, biases
            raise ValueError(f"{weights} holds {key}, which is not a plain LoRA A or B weight; {INSTEAD}")
        found.setdefault(match[1], {})[match[2]] = tensor
    for module, ab in found.items():
        if len(ab) != 2:
            raise ValueError(f"{weights} has {', '.join(ab)} of {module} but not both lora_A and lora_B")
    return {module: (ab["lora_A"], ab["lora_B"]) for module, ab in found.items()}


def _tensor_name(module: str, adapter: Path) -> str:
    match = re.fullmatch(r"model\.layers\.(\d+)\.(\w+\.\w+)", module)
    if match is None or match[2] not in TENSOR_NAMES:
        raise ValueError(
            f"{adapter} adapts {module}, which has no llama.cpp LoRA tensor (only the attention and MLP projections "
            f"of each block have: {', '.join(TENSOR_NAMES)}); fine-tune with target_modules limited to those, or "
            "export with --format merged-bf16"
        )
    return f"blk.{match[1]}.{TENSOR_NAMES[match[2]]}.weight"


def _pair_rows(b: np.ndarray, heads: int) -> np.ndarray:
    """B's rows in llama.cpp's order: each head's two halves [x0..x(d/2-1) | y0..] interleaved as x0 y0 x1 y1 ..."""
    return b.reshape(heads, 2, -1, b.shape[-1]).swapaxes(1, 2).reshape(b.shape)


def check_gguf_base(gguf_path: str | Path, adapter: GGUFAdapter) -> None:
    """Raise ValueError unless the base GGUF at `gguf_path` is a model `adapter` applies to: the same llama.cpp
    architecture, block count, embedding length and shape of every tensor the adapter modifies."""
    try:
        reader = gguf.GGUFReader(gguf_path)
    except (OSError, ValueError) as err:
        raise ValueError(f"--base-gguf {str(gguf_path)!r} cannot be read as a GGUF file ({err})") from None

    def value(key: str):
        found = reader.fields.get(key)
        return None if found is None else found.contents()

    nvfp4 = getattr(gguf.GGMLQuantizationType, "NVFP4", None)
    scaled = {t.name.removesuffix("scale") + "weight" for t in reader.tensors if t.name.endswith(".scale")}
    packed = [
        t.name for t in reader.tensors if t.tensor_type == nvfp4 and t.name in scaled and t.name in adapter.tensors
    ]
    if packed:
        raise ValueError(
            f"--base-gguf {str(gguf_path)!r} holds NVFP4 tensors with a per-tensor scale ({packed[0]}, ...), and this "
            "llama.cpp aborts when a LoRA is applied to one, so it refuses that pair; export the adapter merged into "
            "one file instead (--format gguf)"
        )
    architecture = value(gguf.Keys.General.ARCHITECTURE)
    differ = []
    if architecture != adapter.architecture:
        differ.append(f"architecture {architecture!r} vs {adapter.architecture!r}")
    else:
        for key, mine in ((gguf.Keys.LLM.BLOCK_COUNT, adapter.block_count),
                          (gguf.Keys.LLM.EMBEDDING_LENGTH, adapter.embedding_length)):  # fmt: skip
            theirs = value(key.format(arch=architecture))
            if theirs != mine:
                differ.append(f"{key.format(arch=architecture)} {theirs} vs {mine}")
        shapes = {t.name: tuple(int(n) for n in t.shape) for t in reader.tensors}  # GGUF order: (in, out)
        for name, (a, b) in adapter.tensors.items():
            if shapes.get(name) != (a.shape[1], b.shape[0]):
                theirs = "no such tensor" if name not in shapes else shapes[name]
                differ.append(f"{name} {theirs} vs {(a.shape[1], b.shape[0])}")
    if differ:
        shown = "; ".join(differ[:4]) + (f"; and {len(differ) - 4} more" if len(differ) > 4 else "")
        raise ValueError(
            f"--base-gguf {str(gguf_path)!r} is not the model the adapter {adapter.source} was trained on (its base "
            f"{adapter.base}): {shown} (the GGUF's vs the adapter's); pass the GGUF of that base"
        )


def export_gguf_lora(
    adapter: str | Path, output: str | Path, base: str | None = None, base_gguf: str | Path | None = None
) -> Path:
    """Write the adapter at `adapter` (trained on `base`; None: the default model) as a llama.cpp LoRA GGUF at
    `output`, a new file; with `base_gguf`, first check that it is a GGUF of that base. Returns `output`."""
    output = Path(output)
    if output.exists():
        raise FileExistsError(f"--output {str(output)!r} exists; pass a new file name")
    lora = read_adapter(adapter, base)
    if base_gguf is not None:
        check_gguf_base(base_gguf, lora)
    writer = gguf.GGUFWriter(None, lora.architecture)  # gathers all in memory; the file comes at write_*
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, lora.alpha)
    for name, (a, b) in lora.tensors.items():
        writer.add_tensor(f"{name}.lora_a", a)
        writer.add_tensor(f"{name}.lora_b", b)
    output.parent.mkdir(parents=True, exist_ok=True)
    return write_gguf_file(writer, output, sum(a.nbytes + b.nbytes for a, b in lora.tensors.values()))


def write_gguf_file(writer: gguf.GGUFWriter, output: Path, size: int) -> Path:
    """Write what `writer` gathered to `output` (about `size` bytes): aside, then renamed, so a failed export leaves
    no half-written file at `output`; a full disk is a `NoSpaceError` saying how much is needed. Not mkstemp: its
    file would keep mode 0600 where the user's umask gives their other files 0644."""
    tmp = output.with_name(f".{output.name}-partial-{os.getpid()}")
    try:
        writer.write_header_to_file(tmp)
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(tmp, output)
    except Exception as err:
        if not ran_out_of_space(err, output.parent, size):
            raise
        writer.close()
        tmp.unlink(missing_ok=True)  # before the free space is measured: the message gives what the user has
        raise NoSpaceError(output.parent, output.name, size, free_bytes(output.parent), RUN_AGAIN) from err
    finally:
        writer.close()  # again after a failure: the file is closed before it is removed
        tmp.unlink(missing_ok=True)
    return output


__all__ = ["GGUFAdapter", "check_gguf_base", "export_gguf_lora", "read_adapter", "write_gguf_file"]
