"""`pact export --format gguf-lora`: the file read back equals the adapter in llama.cpp's layout, clear refusals, and
(slow) llama.cpp itself, given the main job's adapter on the default model's Q4_1 GGUF, classifies as PACT did."""

import json
import math
import re

import gguf
import numpy as np
import pytest
import torch
from conftest import tiny_model
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, GemmaConfig

from optimum_pact.commands.cli import main
from optimum_pact.commands.data import format_example, load_personal_dataset
from optimum_pact.commands.default_model import default_gguf_path, ensure_default_model
from optimum_pact.commands.gguf_lora import check_gguf_base, export_gguf_lora, read_adapter
from optimum_pact.commands.llama_score import llama_cpp_accuracy
from optimum_pact.errors import NoSpaceError

PROJECTIONS = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
               "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}  # fmt: skip


def _adapter(model, out, save_embedding_layers="auto", **options):
    """A LoRA adapter with random (non-zero) A and B, saved as plain PEFT files."""
    torch.manual_seed(0)
    config = LoraConfig(**{"r": 4, "lora_alpha": 8, "target_modules": "all-linear", "init_lora_weights": False,
                           **options})  # fmt: skip
    get_peft_model(model, config).save_pretrained(out, save_embedding_layers=save_embedding_layers)
    return out


@pytest.fixture(scope="module")
def adapter(small_model, tmp_path_factory):
    return _adapter(AutoModelForCausalLM.from_pretrained(small_model), tmp_path_factory.mktemp("lora") / "adapter")


def _llama_cpp_rows(heads: int, head_dim: int) -> list[int]:
    """HF row of each llama.cpp q/k row: llama.cpp keeps a head's rotated pairs side by side (x0 y0 x1 y1 ...),
    HF's Llama its two halves apart (x0 x1 ... y0 y1 ...)."""
    half = head_dim // 2
    return [h * head_dim + j * half + i for h in range(heads) for i in range(half) for j in range(2)]


@pytest.mark.parametrize(("arch", "rslora"), [("llama", False), ("qwen2", False), ("llama", True)])
def test_the_gguf_holds_the_adapters_a_and_b_under_llama_cpp_names_with_its_q_k_rows(arch, rslora, tmp_path):
    model = tiny_model(arch)
    model.save_pretrained(tmp_path / "base")
    adapter = _adapter(model, tmp_path / "adapter", use_rslora=rslora)
    out = export_gguf_lora(adapter, tmp_path / "adapter.gguf", str(tmp_path / "base"))

    reader = gguf.GGUFReader(out)
    fields = {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}
    alpha = 8 * math.sqrt(4) if rslora else 8  # llama.cpp's alpha / r is peft's scaling: 8 / sqrt(4) with rsLoRA
    assert fields == {"general.architecture": arch, "general.type": "adapter", "adapter.type": "lora",
                      "adapter.lora.alpha": alpha}  # fmt: skip
    tensors = {t.name: t for t in reader.tensors}
    weights = load_file(adapter / "adapter_model.safetensors")
    assert len(tensors) == len(weights) == 2 * 2 * 7
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    for block in range(2):
        for module, name in PROJECTIONS.items():
            part = "self_attn" if name.startswith("attn") else "mlp"
            key = f"base_model.model.model.layers.{block}.{part}.{module}"
            a, b = weights[f"{key}.lora_A.weight"].numpy(), weights[f"{key}.lora_B.weight"].numpy()
            heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}.get(module)
            if arch == "llama" and heads is not None:
                moved = b[_llama_cpp_rows(heads, head_dim)]
                assert not np.array_equal(moved, b)  # so the check below sees a missing or wrong reordering
                b = moved
            lora_a, lora_b = tensors[f"blk.{block}.{name}.weight.lora_a"], tensors[f"blk.{block}.{name}.weight.lora_b"]
            # GGUF lists dimensions innermost first: lora_a is (in, r), lora_b (r, out), as llama.cpp checks
            assert list(lora_a.shape) == [a.shape[1], 4] and list(lora_b.shape) == [4, b.shape[0]]
            assert lora_a.tensor_type == lora_b.tensor_type == gguf.GGMLQuantizationType.F32
            np.testing.assert_array_equal(lora_a.data, a)
            np.testing.assert_array_equal(lora_b.data, b)


def test_pact_export_writes_the_gguf_and_checks_the_base_gguf_first(small_model, adapter, tmp_path, capsys):
    base = ["export", "--format", "gguf-lora", "--adapter", str(adapter), "--model", str(small_model)]
    assert main([*base, "--output", str(tmp_path / "a.gguf")]) == 0
    assert "exported" in capsys.readouterr().out and (tmp_path / "a.gguf").is_file()

    # the default model's GGUF: 30 blocks of 576, not the 2 of 64 this adapter was trained on
    assert main([*base, "--output", str(tmp_path / "b.gguf"), "--base-gguf", str(default_gguf_path())]) == 2
    err = capsys.readouterr().err
    assert f"--base-gguf '{default_gguf_path()}' is not the model the adapter {adapter} was trained on" in err
    assert "llama.block_count 30 vs 2; llama.embedding_length 576 vs 64" in err
    assert "blk.0.ffn_down.weight (1536, 576) vs (128, 64)" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.gguf"]  # nothing half-written

    assert main([*base, "--output", str(tmp_path / "a.gguf")]) == 2
    assert f"--output '{tmp_path / 'a.gguf'}' exists; pass a new file name" in capsys.readouterr().err
    assert main(["export", "--adapter", str(adapter), "--output", str(tmp_path / "m"), "--base-gguf", "x.gguf"]) == 2
    assert "--base-gguf is for --format gguf-lora, not 'merged-bf16'" in capsys.readouterr().err


def test_a_gguf_of_another_architecture_or_no_gguf_at_all_is_refused_as_the_base(tmp_path):
    model = tiny_model("qwen2")
    model.save_pretrained(tmp_path / "base")
    qwen2 = read_adapter(_adapter(model, tmp_path / "adapter"), str(tmp_path / "base"))
    with pytest.raises(ValueError, match="architecture 'llama' vs 'qwen2' \\(the GGUF's vs the adapter's\\)"):
        check_gguf_base(default_gguf_path(), qwen2)
    (tmp_path / "notes.txt").write_text("not a model")
    with pytest.raises(ValueError, match="notes.txt' cannot be read as a GGUF file"):
        check_gguf_base(tmp_path / "notes.txt", qwen2)


def test_an_existing_output_is_left_alone(small_model, adapter, tmp_path):
    taken = tmp_path / "taken.gguf"
    taken.write_text("mine")
    with pytest.raises(FileExistsError, match="--output '.*taken.gguf' exists; pass a new file name"):
        export_gguf_lora(adapter, taken, str(small_model))
    assert taken.read_text() == "mine"


def test_a_failed_write_leaves_no_file_behind(small_model, adapter, tmp_path, monkeypatch):
    def disk_full(self, *args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", disk_full)
    with pytest.raises(NoSpaceError, match=f"no space left in {tmp_path / 'out'} while saving adapter.gguf"):
        export_gguf_lora(adapter, tmp_path / "out" / "adapter.gguf", str(small_model))
    assert list((tmp_path / "out").iterdir()) == []


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"use_dora": True}, "adapter_config.json sets use_dora=True, which a llama.cpp LoRA GGUF cannot hold"),
        # peft saves the embedding weights with an lm_head LoRA by default, and without them when told
        ({"target_modules": ["lm_head"]}, "holds base_model.model.lm_head.base_layer.weight, which is not a plain"),
        (
            {"target_modules": ["lm_head"], "save_embedding_layers": False},
            "adapts lm_head, which has no llama.cpp LoRA tensor",
        ),
        ({"modules_to_save": ["lm_head"]}, re.escape("sets modules_to_save=['lm_head']")),
    ],
)
def test_what_is_not_plain_lora_is_refused_by_name(tmp_path, options, message):
    model = tiny_model("llama")  # untied lm_head: peft saves its LoRA alone, not the embeddings with it
    model.save_pretrained(tmp_path / "base")
    adapter = _adapter(model, tmp_path / "adapter", **options)
    with pytest.raises(ValueError, match=message):
        export_gguf_lora(adapter, tmp_path / "out.gguf", str(tmp_path / "base"))
    assert not (tmp_path / "out.gguf").exists()


def test_a_wrong_base_or_a_folder_without_weights_is_a_clear_error(small_model, adapter, tmp_path):
    gemma = tmp_path / "gemma"
    GemmaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2).save_pretrained(gemma)
    with pytest.raises(ValueError, match="is a 'gemma' model, and --format gguf-lora supports llama, qwen2 only"):
        export_gguf_lora(adapter, tmp_path / "out.gguf", str(gemma))
    # another base: the default model, whose down_proj is 576 x 1536, not this adapter's 64 x 128
    with pytest.raises(ValueError, match=re.escape("down_proj has LoRA A (4, 128) and B (64, 4), which do not fit")):
        export_gguf_lora(adapter, tmp_path / "out.gguf", str(ensure_default_model()))
    config_only = tmp_path / "config_only"
    config_only.mkdir()
    (config_only / "adapter_config.json").write_bytes((adapter / "adapter_config.json").read_bytes())
    with pytest.raises(FileNotFoundError, match="holds no adapter weights \\(adapter_model.safetensors\\)"):
        export_gguf_lora(config_only, tmp_path / "out.gguf", str(small_model))
    assert not (tmp_path / "out.gguf").exists()


# -- llama.cpp itself --------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_llama_cpp_computes_with_the_exported_lora_what_peft_does(tmp_path):
    llama_cpp = pytest.importorskip("llama_cpp", reason="needs llama-cpp-python (optimum-pact[llama])")
    base = ensure_default_model()  # the Q4_1 GGUF's weights dequantized: the same base on both sides
    adapter = _adapter(AutoModelForCausalLM.from_pretrained(base), tmp_path / "adapter", r=8, lora_alpha=16)
    lora = export_gguf_lora(adapter, tmp_path / "adapter.gguf", base_gguf=default_gguf_path())
    ids = AutoTokenizer.from_pretrained(base)(format_example("call the plumber about the leak", "")[0])["input_ids"]
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), adapter)
    with torch.no_grad():
        peft_with = model(torch.tensor([ids])).logits[0].double()
        with model.disable_adapter():
            peft_without = model(torch.tensor([ids])).logits[0].double()

    def logits(**lora_path) -> torch.Tensor:
        llm = llama_cpp.Llama(
            model_path=str(default_gguf_path()), logits_all=True, n_ctx=64, n_threads=2, verbose=False, **lora_path
        )
        try:
            llm.eval(ids)
            return torch.from_numpy(llm.scores[: len(ids)]).double()
        finally:
            llm.close()

    # llama.cpp runs the base in Q4_1 with 8-bit activations: its own gap to peft's float32, LoRA or not, is that
    # noise (~1.2 here). The LoRA moves the logits by ~19; with q/k rows left in HF's order the gap grows to ~8.
    noise = (logits() - peft_without).abs().max().item()
    gap = (logits(lora_path=str(lora)) - peft_with).abs().max().item()
    assert (peft_with - peft_without).abs().max().item() > 10 * noise, noise
    assert gap < 2 * noise, (gap, noise)


@pytest.mark.slow
def test_llama_cpp_with_the_exported_lora_classifies_as_pact_did(main_job, tmp_path):
    pytest.importorskip("llama_cpp", reason="needs llama-cpp-python (optimum-pact[llama])")
    out, proc = main_job
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    base = default_gguf_path()
    lora = export_gguf_lora(out / "adapter", tmp_path / "adapter.gguf", base_gguf=base)
    tokenizer = AutoTokenizer.from_pretrained(summary["model"])
    train, heldout = load_personal_dataset()
    labels = sorted({item["label"] for item in train + heldout})  # the candidates finetune scores

    def accuracy(**lora_path) -> float:
        return llama_cpp_accuracy(base, tokenizer, heldout, labels, n_threads=2, **lora_path)

    with_lora, alone = accuracy(lora_path=str(lora)), accuracy()
    print(f"llama.cpp + LoRA {with_lora:.3f}, llama.cpp alone {alone:.3f}, PACT {summary['accuracy_after']:.3f}")
    # within 3 of the 60 notes (on the Q4_1 base, not the NVFP4 one it trained on); counted in notes: 0.05 in floats
    # fails by rounding for 52 against 49 notes
    assert abs(round(60 * with_lora) - round(60 * summary["accuracy_after"])) <= 3, (with_lora, summary)
    assert with_lora >= alone + 0.2, (with_lora, alone)
