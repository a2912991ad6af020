"""Every face on a Gemma 3 (the architecture of `--model gemma-3-270m`), small random weights: the main job trains
it, stock peft loads the adapter, generate answers with the base the adapter records, and the GGUF export, which does
not write gemma3 yet, refuses it by name and writes nothing."""

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer, Gemma3ForCausalLM, Gemma3TextConfig

from optimum_pact.commands.cli import main


@pytest.fixture(scope="module")
def gemma3(small_model, tmp_path_factory):
    folder = tmp_path_factory.mktemp("gemma3")
    tokenizer = AutoTokenizer.from_pretrained(small_model)  # SmolLM2's: the main job's prompts, in seconds
    torch.manual_seed(0)
    config = Gemma3TextConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=32,
    )  # fmt: skip
    Gemma3ForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_gemma3_trains_loads_in_stock_peft_answers_and_its_gguf_is_refused(gemma3, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["finetune", "--model", str(gemma3), "--output", str(out), "--max_steps", "3"]) == 0
    adapter = out / "adapter"
    stock = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(gemma3), adapter)
    assert any("lora_A" in name for name, _ in stock.named_parameters())
    capsys.readouterr()
    assert main(["generate", "--adapter", str(adapter), "--max_new_tokens", "4", "dentist on Friday"]) == 0
    assert capsys.readouterr().out.strip()  # no --model: the adapter's own base, not the default model
    gguf = tmp_path / "me.gguf"
    assert main(["export", "--format", "gguf", "--adapter", str(adapter), "--output", str(gguf)]) == 2
    err = capsys.readouterr().err
    assert "is a 'gemma3_text' model, and --format gguf supports llama, qwen2 only" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # nothing half-written
