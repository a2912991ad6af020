"""`pact finetune`: clear errors for bad input, and (slow) the main job end to end on the real model."""

import json
import subprocess
import sys

import pytest

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
    assert main(["finetune", "--backend", "npu"]) == 2
    assert "backend='npu'" in capsys.readouterr().err


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
