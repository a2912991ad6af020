"""`pact finetune`: clear errors for bad input, and (slow) the main job end to end on the real model."""

import json
import subprocess
import sys

import pytest

from optimum_pact.backends.qnn import is_qnn_available
from optimum_pact.cli import main


def test_missing_model_path_is_a_clear_error(capsys):
    assert main(["finetune", "--model", "./no/such/model"]) == 2
    err = capsys.readouterr().err
    assert "--model './no/such/model' does not exist" in err


def test_data_file_with_missing_field_is_a_clear_error(tmp_path, capsys):
    data = tmp_path / "items.jsonl"
    data.write_text('{"text": "buy milk", "label": "errand"}\n{"text": "call mum"}\n')
    assert main(["finetune", "--data", str(data)]) == 2
    err = capsys.readouterr().err
    assert "line 2" in err and "label" in err


def test_unknown_backend_is_a_clear_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["finetune", "--backend", "npu"])
    assert exit_info.value.code == 2
    assert "--backend: invalid choice: 'npu'" in capsys.readouterr().err


@pytest.mark.slow
def test_main_job_end_to_end(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "optimum_pact.cli", "finetune", "--output", str(out)],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "PACT fine-tune summary" in proc.stdout and "held-out accuracy" in proc.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["accuracy_after"] >= summary["accuracy_before"] + 0.2, summary
    assert summary["frozen_linears"] == 30 * 7

    # the adapter is plain PEFT: stock peft loads it on the unquantized base
    from peft import PeftModel
    from peft.tuners.lora import Linear as LoraLinear
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(summary["model"])
    model = PeftModel.from_pretrained(base, out / "adapter")
    assert sum(isinstance(m, LoraLinear) for m in model.modules()) == 30 * 7
    assert (out / "adapter" / "pact_config.json").is_file()


@pytest.fixture(scope="module")
def small_model(tmp_path_factory):
    """SmolLM2's tokenizer on a 2-block model of random weights: the main job's code path, in seconds."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from optimum_pact.default_model import ensure_default_model

    folder = tmp_path_factory.mktemp("small_model")
    tokenizer = AutoTokenizer.from_pretrained(ensure_default_model())
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_soc_model_without_qnn_is_a_clear_error(capsys):
    assert main(["finetune", "--soc-model", "69"]) == 2
    assert "--soc-model '69' applies to --backend qnn" in capsys.readouterr().err


def test_main_job_with_a_precision_plan(small_model, tmp_path, capsys):
    out = tmp_path / "run"
    args = ["finetune", "--model", str(small_model), "--output", str(out), "--max-steps", "3"]
    assert main([*args, "--precision-budget-mib", "0.05", "--dtype", "float32"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["products"] == {"torch": 3 * (14 + 11)} and 0 < summary["fp16_linears"] < 14
    plan = json.loads((out / "adapter" / "pact_config.json").read_text())["precision_plan"]
    assert sum(p == "fp16" for p in plan.values()) == summary["fp16_linears"] and len(plan) == 14
    assert "kept 16-bit" in capsys.readouterr().out


@pytest.mark.skipif(not is_qnn_available(), reason="needs onnxruntime-qnn (optimum-pact[qnn])")
def test_main_job_on_qnn_runs_every_frozen_product_on_the_npu(small_model, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PACT_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "run"
    args = ["finetune", "--model", str(small_model), "--output", str(out), "--max-steps", "2", "--backend", "qnn"]
    assert main([*args, "--soc-model", "60"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["backend"] == "qnn" and summary["products"] == {"qnn": 2 * (14 + 11)}
    assert "all on qnn" in capsys.readouterr().out


def test_main_job_with_aqlora_speed(small_model, tmp_path):
    out = tmp_path / "run"
    args = ["finetune", "--model", str(small_model), "--output", str(out), "--max-steps", "3", "--dtype", "float32"]
    assert main([*args, "--protect-fraction", "0.2", "--adapt", "speed", "--adapt-top-blocks", "1"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["fp16_linears"] == 3 and summary["frozen_linears"] == 14
    pact = json.loads((out / "adapter" / "pact_config.json").read_text())
    assert pact["adapt"] == "speed" and len(pact["protected_modules"]) == 3
    assert json.loads((out / "adapter" / "adapter_config.json").read_text())["layers_to_transform"] == [1]


def test_bad_aqlora_option_is_a_clear_cli_error(capsys):
    assert main(["finetune", "--protect-fraction", "1.5"]) == 2
    assert "--protect-fraction=1.5 is outside the valid range [0, 1]" in capsys.readouterr().err


def test_main_job_with_memory_savers(small_model, tmp_path, capsys):
    out = tmp_path / "run"
    args = ["finetune", "--model", str(small_model), "--output", str(out), "--max-steps", "3", "--dtype", "float32"]
    assert main([*args, "--memory-saver", "full", "--subset-k", "64"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["memory_saver"] == "full" and summary["steps"] == 3
    assert summary["products"] == {"torch": 3 * (14 + 14 + 11)}  # + the recomputed forward of every linear
    assert "(memory savers: full)" in capsys.readouterr().out
    assert not any((out / "trainer" / "pact-offload").iterdir())


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--subset-k", "10"], "--subset-k=10 is used by --memory-saver='full' only"),
        (["--offload-dir", "/tmp/x"], "--offload-dir is used by --memory-saver exact/full only"),
        (["--memory-saver", "full", "--subset-k", "0"], "--subset-k=0 must be a positive integer"),
    ],
)
def test_bad_memory_saver_flags_are_clear_cli_errors(flags, message, capsys):
    assert main(["finetune", *flags]) == 2
    assert message in capsys.readouterr().err
