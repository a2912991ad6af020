"""`pact export --format gguf`: the personal model as one llama.cpp file, its linears in llama.cpp's own NVFP4.

    pact export --format gguf --adapter my-run/adapter --output me.gguf

By default the adapter is merged as `--format nvfp4-merged` merges it (the merge that keeps the gain, scored, its
report printed); `--no-merge` writes the NVFP4 base the adapter was trained on. Either way the model is a folder on
PACT's NVFP4 layers (the ModelOpt layout) first, and `write_gguf` turns such a folder into a GGUF with gguf's own
GGUFWriter: llama.cpp's names, hyperparameters and BPE tokenizer (vocab, merges, special tokens, chat template),
every NVFP4 linear as GGML type NVFP4 holding PACT's codes and e4m3 block scales unchanged (`nvfp4/gguf.py`), its
per-tensor scale as the float32 tensor `<name>.scale`, and the 16-bit tensors in `--embeddings`; norms and biases
float32. llama and qwen2 only.

`--embeddings auto` (the default) types each 16-bit tensor by its role, as llama.cpp's Q4_K_M files do (theirs: a Q6_K
head, a Q4_K embedding; gguf's Python writer quantizes neither type): the output head Q8_0 (a tied embedding is the
head), a separate token embedding Q4_1 (a table of rows, each read alone), the linears kept 16-bit Q8_0 (the layers
most sensitive to rounding, kept 16-bit because of it: Q5_1 there put llama.cpp 32x further from PACT's merged model,
in KL, for 7% less file). f16, q8_0 and f32 write all three in that type. docs/export.md has what each costs
and keeps (benchmarks/bench_gguf_types.py): at 1.5B, auto is 1.08x the Q4_K_M file the model came from, f16 1.95x, at
the same accuracy; a 5-bit output head is what it avoids.
"""

from __future__ import annotations

import json
import logging
import shutil
from importlib.metadata import version
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoTokenizer

from ..files import aside_folder
from ..nvfp4 import dequantize_reference
from ..nvfp4.gguf import GGML_BLOCK, llama_rows, to_ggml_nvfp4
from ..precision import resolve_dtype
from ..quantizer import PactQuantizationConfig
from .finetune import load_data
from .gguf_lora import ARCHITECTURES, PERMUTED, TENSOR_NAMES, write_gguf_file
from .llama_score import llama_cpp_accuracy, llama_cpp_available
from .model_folder import check_adapter_folder, load_causal_lm, load_tokenizer, resolve_model
from .modeling import read_adapter_config, trained_base
from .nvfp4_merge import SIZE_BUDGET, export_nvfp4_merged, save_merged, save_nvfp4_folder
from .rounded_base import apply_adapter_codes

logger = logging.getLogger(__name__)

_TYPE = gguf.GGMLQuantizationType
# the 16-bit matrices a GGUF types by role: llama.cpp's name -> role (every other one: a linear kept 16-bit)
ROLES = {"output.weight": "output", "token_embd.weight": "token_embd"}
# --embeddings: the GGML type of each role
EMBEDDINGS = {"auto": {"output": _TYPE.Q8_0, "token_embd": _TYPE.Q4_1, "linear": _TYPE.Q8_0},
              "f16": dict.fromkeys(("output", "token_embd", "linear"), _TYPE.F16),
              "q8_0": dict.fromkeys(("output", "token_embd", "linear"), _TYPE.Q8_0),
              "f32": dict.fromkeys(("output", "token_embd", "linear"), _TYPE.F32)}  # fmt: skip
# the tensors outside the blocks, HF name -> llama.cpp's
OUTSIDE = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}  # fmt: skip
NORMS = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
# the llama.cpp architecture each is written as. This llama.cpp's qwen2 graph ignores the NVFP4 per-tensor scales
# (`<name>.scale`), its llama graph applies them; a Qwen2 is a Llama with q/k/v biases and half-rotated heads, so it
# is written as a llama, its q/k rows and biases reordered as a Llama's are (tests/test_gguf_export.py).
WRITTEN_AS = {"llama": "llama", "qwen2": "llama"}
# tokenizer.json pre-tokenizers -> llama.cpp's name for the same splitting (tokenizer.ggml.pre)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_SPLIT = _QWEN2_SPLIT.replace(r"|\p{N}|", r"|\p{N}{1,3}|")
NO_MERGE_REFUSED = (
    "this llama.cpp aborts when a LoRA is applied to an NVFP4 tensor with a per-tensor scale, so a gguf-lora "
    "adapter cannot run on this NVFP4 base; export the adapter merged (--format gguf without --no-merge)"
)


def export_gguf(
    adapter: str | Path,
    output: str | Path,
    base: str | None = None,
    embeddings: str = "auto",
    merge: bool = True,
    data: str | None = None,
    requantize_from: str = "nvfp4",
    keep_16bit: float = 0.0,
    score: bool = True,
    rounding: str = "gptq",
    size_budget: float = SIZE_BUDGET,
) -> Path:
    """Write `adapter` (trained on `base`; None: the default model) merged into its NVFP4 base (`merge=False`: the
    base alone, as trained) as one GGUF at `output`, a new file. The merge is `--format nvfp4-merged`'s, scored on
    `data`'s held-out items and its report printed unless `score=False`. Returns `output`."""
    output = Path(output)
    if output.exists():
        raise FileExistsError(f"--output {str(output)!r} exists; pass a new file name")
    check_embeddings(embeddings)
    adapter = check_adapter_folder(adapter)
    path = resolve_model(base, adapter)
    check_architecture(AutoConfig.from_pretrained(path), path)
    tmp = aside_folder(output.parent, f"{output.name}-model")  # a killed export's is removed by the next one
    try:
        folder = tmp / "model"
        if not merge:
            # the base as the adapter was trained on it ("auto" for an unrecorded dtype: as training picks it)
            dtype, dense = trained_base(read_adapter_config(adapter), path, unrecorded=resolve_dtype("auto"))
            quantization = PactQuantizationConfig(modules_in_16bit=dense or None)
            model = load_causal_lm(path, base, quantization_config=quantization, dtype=dtype)
            apply_adapter_codes(model, adapter)
            folder.mkdir()
            save_nvfp4_folder(model, load_tokenizer(path, base), folder)
            del model
        elif score:
            report = export_nvfp4_merged(
                adapter, folder, base, data, requantize_from, keep_16bit, rounding=rounding, size_budget=size_budget
            )
            print(report.describe())
        else:
            save_merged(
                adapter,
                folder,
                base,
                requantize_from,
                keep_16bit,
                rounding=rounding,
                data=data,
                size_budget=size_budget,
            )
        write_gguf(folder, output, embeddings)
        if score and merge:
            _say_llama_cpp_score(output, folder, data)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if not merge:
        print(f"note: {output} is the NVFP4 base without the adapter; {NO_MERGE_REFUSED}.")
    return output


def _say_llama_cpp_score(output: Path, folder: Path, data: str | None) -> None:
    """Print the written file's own held-out accuracy, as llama.cpp computes it (labelled data, `llama` extra)."""
    form, train, heldout = load_data(data)
    if form != "labelled":
        return
    if not llama_cpp_available():
        print(f"note: {output}'s own score needs llama.cpp: pip install 'optimum-pact[llama]'")
        return
    labels = sorted({item["label"] for item in train + heldout})
    accuracy = llama_cpp_accuracy(output, AutoTokenizer.from_pretrained(folder), heldout, labels)
    print(f"held-out accuracy of {output.name} in llama.cpp: {accuracy:.1%} (the file as a phone runs it)")


def check_embeddings(embeddings: str) -> None:
    if embeddings not in EMBEDDINGS:
        raise ValueError(
            f"--embeddings {embeddings!r} is not one of {', '.join(EMBEDDINGS)}; pass auto (the default: each "
            "16-bit tensor typed by its role), f16, q8_0 (half of f16's size) or f32"
        )


def check_architecture(config, path) -> str:
    """llama.cpp's architecture for `config`; a ValueError naming what does not fit a llama or qwen2 GGUF."""
    architecture = ARCHITECTURES.get(config.model_type)
    if architecture is None:
        raise ValueError(
            f"the base {path} is a {config.model_type!r} model, and --format gguf supports "
            f"{', '.join(ARCHITECTURES)} only; export with --format merged-bf16 and convert it with llama.cpp instead"
        )
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise ValueError(
            f"the base {path} scales its rotary embedding ({rope.get('rope_type', rope.get('type'))}), which "
            "--format gguf does not write; export with --format merged-bf16 and convert it with llama.cpp instead"
        )
    return architecture


def write_gguf(folder: str | Path, output: str | Path, embeddings: str = "auto") -> Path:
    """Write the model folder `folder` (saved on PACT's NVFP4 layers: ModelOpt layout) as a GGUF at `output`."""
    folder, output = Path(folder), Path(output)
    check_embeddings(embeddings)
    if not hasattr(gguf.GGMLQuantizationType, "NVFP4"):
        raise RuntimeError(
            f"--format gguf needs the gguf package with llama.cpp's NVFP4 type (0.19 or later; this is "
            f"{version('gguf')}); run pip install -U gguf"
        )
    config = AutoConfig.from_pretrained(folder)
    architecture = WRITTEN_AS[check_architecture(config, folder)]
    writer = gguf.GGUFWriter(None, architecture)  # gathers all in memory; the file comes at write_*
    _add_hyperparameters(writer, config, output.stem)
    _add_tokenizer(writer, folder, config.vocab_size)
    size = _add_tensors(writer, folder, config, architecture, EMBEDDINGS[embeddings])
    return write_gguf_file(writer, output, size)


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _add_hyperparameters(writer: gguf.GGUFWriter, config, name: str) -> None:
    rope = getattr(config, "rope_parameters", None) or {}
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(name)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(_head_dim(config))
    writer.add_value_length(_head_dim(config))
    writer.add_rope_dimension_count(_head_dim(config))
    writer.add_rope_freq_base(float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_NVFP4)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def _pre_tokenizer(pre: dict | None, where: Path) -> str:
    """llama.cpp's name (tokenizer.ggml.pre) for the pre-tokenizer of tokenizer.json."""
    steps = pre.get("pretokenizers", []) if pre and pre.get("type") == "Sequence" else [pre] if pre else []
    kinds = [step.get("type") for step in steps]
    if kinds == ["ByteLevel"] and steps[0].get("use_regex", True):
        return "gpt-2"
    if kinds == ["Digits", "ByteLevel"] and steps[0].get("individual_digits") and steps[1].get("use_regex", True):
        return "smollm"
    if kinds == ["Split", "ByteLevel"] and not steps[1].get("use_regex", True):
        pattern = steps[0].get("pattern", {}).get("Regex")
        found = {_QWEN2_SPLIT: "qwen2", _LLAMA3_SPLIT: "llama-bpe"}.get(pattern)
        if found is not None:
            return found
    raise ValueError(
        f"{where}/tokenizer.json splits text with a pre-tokenizer ({', '.join(map(str, kinds)) or 'none'}) that "
        "--format gguf does not know llama.cpp's name for; export with --format merged-bf16 and convert it with "
        "llama.cpp's convert_hf_to_gguf.py instead"
    )


def _add_tokenizer(writer: gguf.GGUFWriter, folder: Path, vocab_size: int) -> None:
    """The BPE tokenizer of `folder` as llama.cpp's "gpt2" tokenizer: tokens, their types, merges, special tokens,
    whether to add BOS/EOS (as the HF tokenizer does), the chat template."""
    file = folder / "tokenizer.json"
    if not file.is_file():
        raise ValueError(f"{folder} has no tokenizer.json; --format gguf needs a fast (BPE) tokenizer's files")
    described = json.loads(file.read_text(encoding="utf-8"))
    if described.get("model", {}).get("type") != "BPE":
        raise ValueError(
            f"{file} holds a {described.get('model', {}).get('type')!r} tokenizer; --format gguf writes BPE "
            "tokenizers only: export with --format merged-bf16 and convert it with llama.cpp instead"
        )
    pre = _pre_tokenizer(described.get("pre_tokenizer"), folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    by_id = {i: token for token, i in tokenizer.get_vocab().items()}
    added = tokenizer.added_tokens_decoder
    tokens, types = [], []
    for i in range(max(vocab_size, len(by_id))):
        if i not in by_id:  # the embedding has rows the tokenizer never produces
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        else:
            tokens.append(by_id[i])
            special = i in added and added[i].special
            types.append(
                gguf.TokenType.CONTROL if special
                else gguf.TokenType.USER_DEFINED if i in added else gguf.TokenType.NORMAL
            )  # fmt: skip
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    special = gguf.SpecialVocab(folder, load_merges=True, n_vocab=len(tokens))
    with_specials = tokenizer("a")["input_ids"]
    without = tokenizer("a", add_special_tokens=False)["input_ids"]
    special.add_special_token["bos"] = len(with_specials) > len(without) and with_specials[0] != without[0]
    special.add_special_token["eos"] = len(with_specials) > len(without) and with_specials[-1] != without[-1]
    special.add_to_gguf(writer, quiet=True)


def _read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    found: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as reader:
            for key in reader.keys():
                found[key] = reader.get_tensor(key)
    return found


def _gguf_name(name: str, folder: Path) -> str:
    """llama.cpp's name for the HF tensor `name` (model.layers.N.self_attn.q_proj.weight -> blk.N.attn_q.weight)."""
    if name in OUTSIDE:
        return OUTSIDE[name]
    parts = name.split(".")
    if len(parts) >= 5 and parts[:2] == ["model", "layers"] and parts[2].isdigit():
        block, module, kind = parts[2], ".".join(parts[3:-1]), parts[-1]
        if module in TENSOR_NAMES and kind in ("weight", "bias"):
            return f"blk.{block}.{TENSOR_NAMES[module]}.{kind}"
        if module in NORMS and kind == "weight":
            return f"blk.{block}.{NORMS[module]}.weight"
    raise ValueError(
        f"{folder} holds {name}, which --format gguf has no llama.cpp tensor for; export with --format merged-bf16 "
        "and convert it with llama.cpp instead"
    )


def _add_tensors(writer: gguf.GGUFWriter, folder: Path, config, architecture: str, types: dict) -> int:
    """Every tensor of the folder under llama.cpp's name, a 16-bit matrix in `types`' type for its role ("output",
    "token_embd", "linear"); returns the bytes written."""
    tensors = _read_tensors(folder)
    heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}
    size = 0
    for name in sorted(tensors):
        if name.endswith((".weight_scale", ".weight_scale_2")) or name.endswith("rotary_emb.inv_freq"):
            continue
        tensor = tensors[name]
        if name == "lm_head.weight" and getattr(config, "tie_word_embeddings", False):
            continue  # llama.cpp uses token_embd when there is no output tensor
        target = _gguf_name(name, folder)
        rows = heads.get(name.split(".")[-2]) if architecture in PERMUTED else None
        if tensor.dtype == torch.uint8:  # a packed NVFP4 weight: weight, weight_scale, weight_scale_2
            stem = name.removesuffix("weight")
            qdata, scale, scale_2 = tensor, tensors[f"{stem}weight_scale"], tensors[f"{stem}weight_scale_2"]
            if rows is not None:
                qdata, scale = llama_rows(qdata, rows), llama_rows(scale.view(torch.uint8), rows)
                scale = scale.view(torch.float8_e4m3fn)
            if qdata.shape[1] * 2 % GGML_BLOCK == 0:
                blocks = to_ggml_nvfp4(qdata.contiguous(), scale.contiguous())
                writer.add_tensor(target, blocks, raw_dtype=gguf.GGMLQuantizationType.NVFP4)
                writer.add_tensor(target.removesuffix("weight") + "scale", scale_2.float().reshape(1).numpy())
                size += blocks.nbytes + 4
                continue
            logger.warning("%s: %d inputs are no multiple of %d; written 16-bit", name, qdata.shape[1] * 2, GGML_BLOCK)
            tensor, rows = dequantize_reference(qdata, scale, scale_2), None
        if rows is not None:
            tensor = llama_rows(tensor, rows)
        data = tensor.float().numpy()
        tied = target == "token_embd.weight" and getattr(config, "tie_word_embeddings", False)
        kind = types["output" if tied else ROLES.get(target, "linear")]  # a tied embedding is the output head
        if tensor.dim() == 1:  # norms and biases
            writer.add_tensor(target, data)
        elif kind not in (_TYPE.F16, _TYPE.F32) and data.shape[-1] % gguf.GGML_QUANT_SIZES[kind][0] == 0:
            data = gguf.quants.quantize(data, kind)
            writer.add_tensor(target, data, raw_dtype=kind)
        else:  # f16 asked, or rows no whole number of the type's blocks
            data = data.astype(np.float32 if kind == _TYPE.F32 else np.float16)
            writer.add_tensor(target, data)
        size += data.nbytes
    return size


__all__ = ["EMBEDDINGS", "NO_MERGE_REFUSED", "check_architecture", "export_gguf", "write_gguf"]
