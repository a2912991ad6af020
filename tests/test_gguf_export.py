"""`pact export --format gguf`: the personal model as one llama.cpp file. Its NVFP4 bytes are PACT's (read back with
gguf's own reader and dequantizer), llama.cpp loads it and computes what PACT does, the engine caches it beside the
adapter, and (slow) on the main job's adapter llama.cpp scores and generates as PACT's merged model does."""

import json
import os
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize
from safetensors.torch import load_file
from test_generation import _adapter
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

from optimum_pact.commands.cli import main
from optimum_pact.commands.data import load_personal_dataset
from optimum_pact.commands.generation import parse, run_chat
from optimum_pact.commands.gguf_export import write_gguf
from optimum_pact.commands.llama_engine import GGUF_NAME
from optimum_pact.commands.llama_score import llama_cpp_accuracy
from optimum_pact.commands.nvfp4_merge import export_nvfp4_merged, save_nvfp4_folder
from optimum_pact.dataflow import FrozenLinear
from optimum_pact.nvfp4 import dequantize_reference
from optimum_pact.nvfp4.gguf import from_ggml_nvfp4, llama_rows, to_ggml_nvfp4
from optimum_pact.quantizer import PactQuantizationConfig

NVFP4 = gguf.GGMLQuantizationType.NVFP4
LINEARS = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
           "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
           "mlp.down_proj": "ffn_down"}  # fmt: skip


def _sharpen(model) -> None:
    """Scale q and k up so that attention is peaked, not the near-uniform average of a random model: then which pairs
    of q/k rows the rotary embedding turns together shows in the logits (the control test below)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(8)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def nvfp4_folder(request, small_model, tmp_path_factory):
    """The small model (SmolLM2's tokenizer, 2 random blocks) on PACT's NVFP4 layers, saved; qwen2: the same as a
    Qwen2 (random q/k/v biases; transformers gives it Qwen2's pre-tokenizer), written as llama.cpp's llama."""
    root = tmp_path_factory.mktemp(f"gguf_{request.param}")
    source = root / request.param
    if request.param == "llama":
        model = AutoModelForCausalLM.from_pretrained(small_model)
        _sharpen(model)
        model.save_pretrained(source)
        AutoTokenizer.from_pretrained(small_model).save_pretrained(source)
    else:
        source = root / "qwen2"
        torch.manual_seed(0)
        config = Qwen2Config(
            vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, tie_word_embeddings=True,
        )  # fmt: skip
        model = Qwen2ForCausalLM(config)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("bias"):
                    p.normal_(std=0.5)  # not zeros, so that reordering q/k biases or not shows
        _sharpen(model)
        model.save_pretrained(source)
        AutoTokenizer.from_pretrained(small_model).save_pretrained(source)
    model = AutoModelForCausalLM.from_pretrained(source, quantization_config=PactQuantizationConfig())
    save_nvfp4_folder(model, AutoTokenizer.from_pretrained(source), root / "nvfp4")
    return request.param, root / "nvfp4"


def test_the_packing_is_llama_cpps_nvfp4_bit_for_bit():
    from optimum_pact.nvfp4 import quantize

    q = quantize(torch.randn(48, 256) * 3)
    blocks = to_ggml_nvfp4(q.qdata, q.scale)
    assert blocks.shape == (48, 256 // 64 * 36) and blocks.dtype == np.uint8
    # gguf's reference dequantizer (ue4m3 scale x E2M1 value), times the per-tensor scale as llama.cpp applies it
    theirs = torch.from_numpy(dequantize(blocks, NVFP4)) * q.scale_2
    assert torch.equal(theirs, dequantize_reference(q.qdata, q.scale, q.scale_2))
    qdata, scale = from_ggml_nvfp4(blocks, 256)
    assert torch.equal(qdata, q.qdata) and torch.equal(scale.view(torch.uint8), q.scale.view(torch.uint8))
    with pytest.raises(ValueError, match=r"blocks of 64 weights; a weight of shape \(4, 48\) does not fit"):
        to_ggml_nvfp4(q.qdata[:4, :24], q.scale[:4, :3])


def test_the_gguf_holds_pacts_codes_and_scales_under_llama_cpp_names(nvfp4_folder, tmp_path):
    arch, folder = nvfp4_folder
    out = write_gguf(folder, tmp_path / "model.gguf", embeddings="f16")
    reader = gguf.GGUFReader(out)
    fields = {name: field.contents() for name, field in reader.fields.items()}
    # llama.cpp's qwen2 ignores NVFP4's per-tensor scales; its llama applies them, and a Qwen2 is a Llama with biases
    assert fields["general.architecture"] == "llama"
    assert fields["general.file_type"] == gguf.LlamaFileType.MOSTLY_NVFP4
    assert fields["llama.block_count"] == 2 and fields["llama.embedding_length"] == 64
    assert fields["llama.attention.head_count"] == 4 and fields["llama.attention.head_count_kv"] == 2
    assert fields["tokenizer.ggml.model"] == "gpt2"
    assert fields["tokenizer.ggml.pre"] == {"llama": "gpt-2", "qwen2": "qwen2"}[arch]
    assert len(fields["tokenizer.ggml.tokens"]) == 49152 and len(fields["tokenizer.ggml.merges"]) == 48900
    assert fields["tokenizer.ggml.eos_token_id"] == 2 and fields["tokenizer.ggml.add_bos_token"] is False
    assert fields["tokenizer.chat_template"].startswith("{% for message in messages %}")

    saved = load_file(folder / "model.safetensors")
    tensors = {t.name: t for t in reader.tensors}
    heads = {"self_attn.q_proj": 4, "self_attn.k_proj": 2}
    for block in range(2):
        for module, name in LINEARS.items():
            key = f"model.layers.{block}.{module}"
            qdata, scale = saved[f"{key}.weight"], saved[f"{key}.weight_scale"].view(torch.uint8)
            if module in heads:  # llama.cpp's llama rotates pairs: q/k rows reordered
                qdata, scale = llama_rows(qdata, heads[module]), llama_rows(scale, heads[module])
            weight = tensors[f"blk.{block}.{name}.weight"]
            assert weight.tensor_type == NVFP4 and list(weight.shape) == [qdata.shape[1] * 2, qdata.shape[0]]
            codes, scales = from_ggml_nvfp4(np.asarray(weight.data), qdata.shape[1] * 2)
            assert torch.equal(codes, qdata) and torch.equal(scales.view(torch.uint8), scale)  # PACT's bytes
            scale_2 = tensors[f"blk.{block}.{name}.scale"]
            assert scale_2.tensor_type == gguf.GGMLQuantizationType.F32
            assert np.asarray(scale_2.data).tolist() == [saved[f"{key}.weight_scale_2"].item()]
        assert tensors[f"blk.{block}.attn_norm.weight"].tensor_type == gguf.GGMLQuantizationType.F32
        if arch == "qwen2":
            bias = saved[f"model.layers.{block}.self_attn.q_proj.bias"]
            assert np.array_equal(tensors[f"blk.{block}.attn_q.bias"].data, llama_rows(bias, 4).numpy())
        else:
            assert f"blk.{block}.attn_q.bias" not in tensors
    embedding = tensors["token_embd.weight"]
    assert embedding.tensor_type == gguf.GGMLQuantizationType.F16 and "output.weight" not in tensors  # tied
    assert np.array_equal(embedding.data, saved["model.embed_tokens.weight"].half().numpy())


def test_embeddings_f16_q8_0_f32_and_what_they_cost(nvfp4_folder, tmp_path):
    _, folder = nvfp4_folder
    sizes = {}
    for kind, ggml in (("f32", "F32"), ("f16", "F16"), ("q8_0", "Q8_0"), ("auto", "Q8_0")):
        out = write_gguf(folder, tmp_path / f"{kind}.gguf", embeddings=kind)
        tensors = {t.name: t for t in gguf.GGUFReader(out).tensors}
        assert tensors["token_embd.weight"].tensor_type.name == ggml  # auto: a tied embedding is the output head
        sizes[kind] = out.stat().st_size
    embedding = 49152 * 64  # weights of the embedding, the bulk of this small model
    assert sizes["f32"] - sizes["f16"] == pytest.approx(2 * embedding, rel=0.01)
    assert sizes["f16"] - sizes["q8_0"] == pytest.approx(2 * embedding - embedding * 34 / 32, rel=0.01)
    assert sizes["auto"] == sizes["q8_0"]  # nothing else is 16-bit here
    with pytest.raises(ValueError, match="--embeddings 'bf16' is not one of auto, f16, q8_0, f32"):
        write_gguf(folder, tmp_path / "x.gguf", embeddings="bf16")


def test_auto_types_a_separate_embedding_q4_1_and_16_bit_linears_q8_0_and_llama_cpp_runs_it(small_model, tmp_path):
    """A model with its own output matrix and one linear kept 16-bit: each in its role's type, and llama.cpp's logits
    on the file stay near PACT's on the folder (4- and 8-bit weights there: nearer than a wrong layout, not equal)."""
    model = AutoModelForCausalLM.from_pretrained(small_model)
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone() * 1.5)
    model.save_pretrained(tmp_path / "untied")
    AutoTokenizer.from_pretrained(small_model).save_pretrained(tmp_path / "untied")
    kept = "model.layers.0.mlp.down_proj"
    quantization = PactQuantizationConfig(modules_in_16bit=[kept])
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "untied", quantization_config=quantization)
    assert model.get_submodule(kept).precision == "fp16"
    save_nvfp4_folder(model, AutoTokenizer.from_pretrained(small_model), tmp_path / "nvfp4")
    out = write_gguf(tmp_path / "nvfp4", tmp_path / "auto.gguf")
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(out).tensors}
    assert types["output.weight"] == "Q8_0" and types["token_embd.weight"] == "Q4_1"
    assert types["blk.0.ffn_down.weight"] == "Q8_0" and types["blk.1.ffn_down.weight"] == "NVFP4"
    gap, agree = _largest_gap(tmp_path / "nvfp4", out)
    assert gap < 0.1 and agree >= 0.8, (gap, agree)


def test_transformers_still_loads_the_folder_through_pacts_quantizer(nvfp4_folder):
    _, folder = nvfp4_folder
    modelopt = json.loads((folder / "hf_quant_config.json").read_text())
    assert modelopt["quantization"] == {"quant_algo": "W4A16_NVFP4", "kv_cache_quant_algo": None, "group_size": 16,
                                        "exclude_modules": ["lm_head"]}  # fmt: skip
    assert modelopt["producer"]["name"] == "optimum-pact"
    assert json.loads((folder / "config.json").read_text())["quantization_config"]["quant_method"] == "pact"
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert sum(isinstance(m, FrozenLinear) for m in model.modules()) == 14


def _llama(path, **kwargs):
    llama_cpp = pytest.importorskip("llama_cpp", reason="needs llama-cpp-python (optimum-pact[llama])")
    return llama_cpp.Llama(model_path=str(path), **{"n_ctx": 256, "n_threads": 2, "verbose": False, **kwargs})


def _largest_gap(folder, out) -> tuple[float, float]:
    """llama.cpp's logits on the file `out` against PACT's on `folder`: the largest gap as a share of the largest
    logit, and the share of positions whose argmax agrees."""
    tokenizer = AutoTokenizer.from_pretrained(folder)
    text = "Mum: Lunch on Sunday?\nMe: yes, bringing the lemon cake 1234"
    ids = tokenizer(text)["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        pact = model(torch.tensor([ids])).logits[0].double()
    llm = _llama(out, logits_all=True)
    try:
        assert llm.tokenize(text.encode(), add_bos=True, special=True) == ids  # its tokenizer is the HF one
        llm.eval(ids)
        theirs = torch.from_numpy(llm.scores[: len(ids)]).double()
    finally:
        llm.close()
    gap = (theirs - pact).abs().max().item() / pact.abs().max().item()
    return gap, (theirs.argmax(-1) == pact.argmax(-1)).double().mean().item()


def test_llama_cpp_computes_what_pact_does_from_the_file(nvfp4_folder, tmp_path):
    arch, folder = nvfp4_folder
    gap, agree = _largest_gap(folder, write_gguf(folder, tmp_path / "model.gguf", embeddings="f32"))
    # llama.cpp multiplies with 8-bit activations: close, not equal. Wrong q/k rows, nibbles or scales are far off.
    # (A random model's top logits nearly tie: an argmax may differ where they do.)
    print(f"{arch}: largest gap {gap:.4f} of the largest logit, argmax agrees at {agree:.0%}")
    assert gap < 0.02, gap
    assert agree >= 0.9


def test_q_and_k_rows_in_the_wrong_order_fail_the_check_above(nvfp4_folder, tmp_path, monkeypatch):
    """The negative control: the same file with q/k rows (and biases) left in HF's order is far off in llama.cpp."""
    _, folder = nvfp4_folder
    monkeypatch.setattr("optimum_pact.commands.gguf_export.llama_rows", lambda tensor, heads: tensor)
    gap, _ = _largest_gap(folder, write_gguf(folder, tmp_path / "wrong.gguf", embeddings="f32"))
    print(f"q/k rows in HF order: largest gap {gap:.4f}")
    assert gap > 0.05, gap


def test_a_16bit_linear_is_a_16bit_ggml_tensor_merged_exactly(small_model, tmp_path):
    """An adapter trained with some linears 16-bit: with --embeddings f16 the GGUF mixes NVFP4 and F16 (auto writes
    them Q8_0, tested above), the 16-bit ones merged exactly."""
    from peft import get_peft_model

    from peft_ext import PactConfig

    sixteen = ["model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj"]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(small_model, dtype=torch.bfloat16)
    config = PactConfig(r=4, target_modules="all-linear", init_lora_weights=False, protected_modules=sixteen)
    model = get_peft_model(model, config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(20)
    model.save_pretrained(tmp_path / "adapter")
    out = tmp_path / "me.gguf"
    assert main(["export", "--format", "gguf", "--adapter", str(tmp_path / "adapter"), "--model", str(small_model),
                 "--output", str(out), "--size_budget", "1", "--embeddings", "f16"]) == 0  # fmt: skip
    tensors = {t.name: t for t in gguf.GGUFReader(out).tensors}
    types = {name: tensors[f"blk.{b}.{short}.weight"].tensor_type.name for b in range(2)
             for module, short in LINEARS.items() for name in [f"model.layers.{b}.{module}"]}  # fmt: skip
    assert {name for name, kind in types.items() if kind == "F16"} == set(sixteen)
    assert {kind for name, kind in types.items() if name not in sixteen} == {"NVFP4"}
    for name, heads in zip(sixteen, (4, None)):
        layer = model.get_submodule("base_model.model." + name)
        with torch.no_grad():
            exact = layer.get_base_layer().dequantize(torch.float32) + layer.get_delta_weight("default").float()
        exact = llama_rows(exact, heads) if heads else exact
        short = tensors[f"blk.{name.split('.')[2]}.{LINEARS['.'.join(name.split('.')[3:])]}.weight"]
        # W16 + B A, rounded once: to the bf16 of the merged folder, then f16 in the file
        assert np.array_equal(np.asarray(short.data), exact.bfloat16().float().half().numpy()), name


def test_pact_export_gguf_merged_and_no_merge_and_llama_cpps_lora_refusal(small_model, tmp_path, capsys):
    adapter = _adapter(small_model, tmp_path / "adapter", seed=1)
    base = ["export", "--format", "gguf", "--adapter", str(adapter), "--model", str(small_model)]
    assert main([*base, "--output", str(tmp_path / "me.gguf"), "--size_budget", "1.005"]) == 0  # room for a few
    out = capsys.readouterr().out
    assert "held-out accuracy: base" in out and f"exported {adapter} as gguf" in out  # the merge's report
    assert main([*base, "--no-merge", "--embeddings", "q8_0", "--output", str(tmp_path / "base.gguf")]) == 0
    assert (
        "is the NVFP4 base without the adapter; this llama.cpp aborts when a LoRA is applied"
        in capsys.readouterr().out
    )
    merged = {t.name: t for t in gguf.GGUFReader(tmp_path / "me.gguf").tensors}
    unmerged = {t.name: t for t in gguf.GGUFReader(tmp_path / "base.gguf").tensors}
    linears = [name for name, t in unmerged.items() if t.tensor_type == NVFP4]
    rounded = [name for name in linears if merged[name].tensor_type == NVFP4]
    kept = [name for name in linears if merged[name].tensor_type == gguf.GGMLQuantizationType.Q8_0]
    # the size budget keeps the linears rounded worst 16-bit (Q8_0 in the file: --embeddings auto), and rounds the
    # rest with the change merged
    assert rounded and kept and len(rounded) + len(kept) == len(linears) == 14
    assert not any(np.array_equal(merged[name].data, unmerged[name].data) for name in rounded)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter", "base.gguf", "me.gguf"]  # no leftovers

    lora = ["export", "--format", "gguf-lora", "--adapter", str(adapter), "--model", str(small_model)]
    assert main([*lora, "--output", str(tmp_path / "lora.gguf"), "--base-gguf", str(tmp_path / "base.gguf")]) == 2
    err = capsys.readouterr().err
    assert "holds NVFP4 tensors with a per-tensor scale" in err and "refuses that pair" in err
    assert not (tmp_path / "lora.gguf").exists()
    assert main([*base[:2], "merged-bf16", *base[3:], "--no-merge", "--output", str(tmp_path / "m")]) == 2
    assert "--no-merge is for --format gguf, not 'merged-bf16'" in capsys.readouterr().err


def test_the_llama_cpp_engine_exports_once_and_again_when_the_adapter_changes(small_model, tmp_path, capsys):
    pytest.importorskip("llama_cpp", reason="needs llama-cpp-python (optimum-pact[llama])")
    adapter = _adapter(small_model, tmp_path / "adapter", seed=1)
    argv = ["generate", "--model", str(small_model), "--adapter", str(adapter), "--max_new_tokens", "8"]
    assert main([*argv, "--engine", "llama.cpp", "hello there"]) == 0
    first = capsys.readouterr()
    cached = adapter / GGUF_NAME
    assert cached.is_file() and "exporting" in first.err and first.out.strip()
    stamp = cached.stat().st_mtime_ns
    assert main([*argv, "--engine", "llama.cpp", "hello there"]) == 0
    again = capsys.readouterr()
    assert again.out == first.out and "exporting" not in again.err and cached.stat().st_mtime_ns == stamp

    _adapter(small_model, tmp_path / "other", seed=2)  # retrained: other weights in the same folder
    os.replace(tmp_path / "other" / "adapter_model.safetensors", adapter / "adapter_model.safetensors")
    assert main([*argv, "--engine", "llama.cpp", "hello there"]) == 0
    assert "exporting" in capsys.readouterr().err and cached.stat().st_mtime_ns != stamp

    args, _ = parse(["--model", str(small_model), "--adapter", str(adapter), "--engine", "llama.cpp",
                     "--max_new_tokens", "4"], "chat")  # fmt: skip
    messages = run_chat(args, lines=["hi", "again"])
    assert [m["role"] for m in messages] == ["user", "assistant"] * 2


def test_the_llama_cpp_engine_falls_back_to_pact_and_says_so(small_model, capsys):
    argv = ["generate", "--model", str(small_model), "--max_new_tokens", "3", "--engine", "llama.cpp", "hello"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert err.count("note: --engine llama.cpp decodes an adapter's exported GGUF, and no --adapter was given") == 1
    assert "decoding with --engine pact instead" in err
    assert main([*argv[:-1], "--temperature", "0.8", "hello"]) == 0  # sampling, on PACT as on llama.cpp


def test_the_llama_cpp_engine_samples_at_a_temperature(small_model, tmp_path, capsys):
    pytest.importorskip("llama_cpp", reason="needs llama-cpp-python (optimum-pact[llama])")
    adapter = _adapter(small_model, tmp_path / "adapter", seed=1)
    argv = ["generate", "--model", str(small_model), "--adapter", str(adapter), "--engine", "llama.cpp"]
    assert main([*argv, "--max_new_tokens", "6", "--temperature", "0.8", "--top_p", "0.9", "hello"]) == 0
    assert capsys.readouterr().out.strip()


# -- the main job's adapter, in llama.cpp -------------------------------------------------------------------------


def _gaps_on(model, ids: list[int], theirs: list[int]) -> torch.Tensor:
    """For each token of `theirs` (a continuation of `ids`), how far it falls below the model's top choice there, as
    a share of the largest logit: 0 where the model would pick it too."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids + theirs])).logits[0, len(ids) - 1 : -1].double()
    return (logits.max(-1).values - logits[range(len(theirs)), theirs]) / logits.abs().max()


PROMPTS = ["What should I pack for a weekend hiking trip?", "Write a short note to my landlord about the heating.",
           "Give me three ideas for a quick dinner.", "How do I politely decline a meeting?"]  # fmt: skip


@pytest.mark.slow
def test_llama_cpp_scores_and_generates_as_pacts_merged_model(main_job_merged, tmp_path):
    pytest.importorskip("llama_cpp", reason="needs llama-cpp-python (optimum-pact[llama])")
    folder, report, _ = main_job_merged  # what --format gguf merges, scored
    # f16: the file holds the merged model's own values, so this measures llama.cpp against PACT; what the default
    # types (--embeddings auto) cost on top is benchmarks/bench_gguf_types.py's figure
    model_file = write_gguf(folder, tmp_path / "me.gguf", embeddings="f16")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    train, heldout = load_personal_dataset()
    labels = sorted({item["label"] for item in train + heldout})
    accuracy = llama_cpp_accuracy(model_file, tokenizer, heldout, labels, n_threads=2)

    merged = AutoModelForCausalLM.from_pretrained(folder)  # PACT's merged model, as transformers runs it
    llm = _llama(model_file, n_ctx=512)
    gaps = []
    try:
        for prompt in PROMPTS:
            ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
            ids = ids["input_ids"] if hasattr(ids, "keys") else ids
            theirs = []
            for token in llm.generate(ids, temp=0.0, top_k=1):  # past the end of sequence, as it goes on
                theirs.append(token)
                if len(theirs) == 32:
                    break
            gaps.append(_gaps_on(merged, ids, theirs))  # each of llama.cpp's greedy tokens, where PACT ranks it
    finally:
        llm.close()
    gaps = torch.cat(gaps)
    agree = (gaps == 0).double().mean().item()
    size = model_file.stat().st_size
    print(f"llama.cpp {accuracy:.3f} vs PACT's merged {report.merged:.3f} on {len(heldout)} held-out notes; "
          f"greedy tokens PACT picks too: {agree:.0%} of {len(gaps)}, largest gap {gaps.max():.4f}; "
          f"GGUF {size / 1e6:.1f} MB")  # fmt: skip
    assert abs(accuracy - report.merged) <= 1 / len(heldout) + 1e-9, (accuracy, report)
    # llama.cpp multiplies with 8-bit activations, so where PACT's top two logits nearly tie (0.07% of the largest
    # on this adapter's second prompt) its greedy pick may be the other one, and the two continuations part there.
    # Fed llama.cpp's own tokens, PACT must rank each first or within 1% of the largest logit of first: a wrong
    # row, scale or merge puts its tokens far below.
    assert gaps.max() < 0.01 and agree >= 0.9, (gaps.max(), agree)


def _token_losses(logits: torch.Tensor, rows: list[dict]) -> float:
    """Mean cross-entropy over the labelled tokens of `rows`, from each row's [len, vocab] logits."""
    total, count = 0.0, 0
    for row, row_logits in zip(rows, logits):
        labels = torch.tensor(row["labels"][1:])
        keep = labels != -100
        losses = torch.nn.functional.cross_entropy(row_logits[:-1][keep].float(), labels[keep], reduction="sum")
        total, count = total + losses.item(), count + int(keep.sum())
    return total / count


@pytest.mark.slow
def test_llama_cpp_holds_out_a_chat_adapters_loss_as_pacts_merged_model(tmp_path):
    pytest.importorskip("llama_cpp", reason="needs llama-cpp-python (optimum-pact[llama])")
    from optimum_pact.commands.data.generative import tokenize_generative
    from optimum_pact.commands.finetune import load_data

    run = tmp_path / "chat-run"
    command = [sys.executable, "-m", "optimum_pact.commands.cli", "finetune", "--data", "chat", "--output", str(run)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    merged_folder = tmp_path / "merged"
    export_nvfp4_merged(run / "adapter", merged_folder, data="chat")
    model_file = write_gguf(merged_folder, tmp_path / "chat.gguf", embeddings="f16")  # the merged model's values
    tokenizer = AutoTokenizer.from_pretrained(merged_folder)
    form, _, heldout = load_data("chat")
    rows = tokenize_generative(tokenizer, heldout, form)
    merged = AutoModelForCausalLM.from_pretrained(merged_folder)
    with torch.no_grad():
        pact = _token_losses([merged(input_ids=torch.tensor([r["input_ids"]])).logits[0] for r in rows], rows)
    llm = _llama(model_file, logits_all=True, n_ctx=1024)
    theirs = []
    try:
        for row in rows:
            llm.reset()
            llm.eval(row["input_ids"])
            theirs.append(torch.from_numpy(np.array(llm.scores[: len(row["input_ids"])])))
    finally:
        llm.close()
    llama = _token_losses(theirs, rows)
    print(f"held-out loss of the chat adapter merged: llama.cpp {llama:.4f} vs PACT {pact:.4f} on {len(rows)} rows")
    assert abs(llama - pact) <= 0.02 * pact, (llama, pact)
