"""`pact finetune --background`: lock, SIGTERM / kill -9 and re-run to the same adapter, model card, clear errors."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from peft import PeftModel, get_peft_model
from safetensors.torch import load_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from optimum_pact.commands.cli import main
from peft_ext import PactConfig
from trainer_callbacks.lock import OutputDirLock, OutputDirLockedError
from trainer_callbacks.model_card import write_model_card

ROOT = Path(__file__).resolve().parents[1]
LOCK_PY = ROOT / "trainer_callbacks" / "lock.py"
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
NOTES = [("buy milk and eggs", "errand"), ("call the plumber", "errand"), ("pick up the parcel", "errand"),
         ("renew passport", "errand"), ("idea: a bike light app", "idea"), ("idea: garden sensor", "idea"),
         ("idea: recipe planner", "idea"), ("idea: sleep tracker", "idea")]  # fmt: skip


def make_tiny_model_dir(path: Path, seed: int = 0) -> Path:
    """A saved tiny Llama with a byte-level tokenizer: a model folder `pact finetune --model` accepts, offline."""
    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab["<eos>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<eos>").save_pretrained(path)
    torch.manual_seed(seed)
    LlamaForCausalLM(LlamaConfig(vocab_size=len(vocab), **TINY)).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """A tiny model folder, a data file and the CLI arguments of a short background job."""
    root = tmp_path_factory.mktemp("job")
    model = make_tiny_model_dir(root / "model")
    data = root / "notes.jsonl"
    data.write_text("".join(json.dumps({"text": t, "label": label}) + "\n" for t, label in NOTES))
    (root / "sys").mkdir()  # a sensorless sysfs: pacing warns and runs on
    args = ["finetune", "--model", str(model), "--data", str(data), "--dtype", "float32", "--batch-size", "2",
            "--epochs", "10", "--learning-rate", "0.01", "--background", "--save-steps", "3",
            "--sysfs-root", str(root / "sys")]  # fmt: skip
    return root, args


def _launch(args: list[str]) -> subprocess.Popen:
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "TRANSFORMERS_VERBOSITY": "error", "TQDM_DISABLE": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "optimum_pact.commands.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
    )


def _wait_for(predicate, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert proc.poll() is None, f"exited early: {proc.communicate()[1][-2000:]}"
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def _steps(out: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in (out / "trainer" / "checkpoints").glob("checkpoint-*[0-9]"))


def test_sigterm_and_kill_9_then_rerun_continues_to_the_same_adapter(job, caplog):
    root, args = job
    reference = root / "reference"
    with caplog.at_level(logging.WARNING):
        assert main([*args, "--output", str(reference)]) == 0
    assert "no thermal zone under" in caplog.text  # sensorless: warned, not crashed
    out = root / "killed"
    cli = [*args, "--output", str(out), "--duty-cycle", "0.25"]  # rests 3x each step: time to kill it mid-run

    first = _launch(cli)
    _wait_for(lambda: _steps(out), first)
    first.send_signal(signal.SIGTERM)
    _, err = first.communicate(timeout=120)
    assert first.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert "SIGTERM received: stopped at step" in err and "run the same command again" in err
    stopped_at = _steps(out)[-1]
    assert not (out / ".pact.lock").exists()  # released on the way out

    second = _launch(cli)
    _wait_for(lambda: _steps(out)[-1] > stopped_at, second)
    second.kill()  # kill -9: no handler runs, the lock file stays behind
    second.wait()
    assert (out / ".pact.lock").exists()

    third = _launch(cli)
    stdout, err = third.communicate(timeout=300)
    assert third.returncode == 0, err[-3000:]
    assert "took over a stale lock" in err and "resuming from" in err
    assert "PACT fine-tune summary" in stdout and "resumed from step" in stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["background"]["resumed_from_step"] > stopped_at
    ref = load_file(reference / "adapter" / "adapter_model.safetensors")
    got = load_file(out / "adapter" / "adapter_model.safetensors")
    assert ref.keys() == got.keys() and all(torch.equal(ref[k], got[k]) for k in ref)


def test_adapter_folder_is_hub_ready(job, monkeypatch, tmp_path):
    root, args = job
    out = root / "reference"
    if not (out / "adapter").is_dir():
        assert main([*args, "--output", str(out)]) == 0
    adapter = out / "adapter"
    assert {p.name for p in adapter.iterdir()} == {
        "adapter_config.json", "adapter_model.safetensors", "pact_config.json", "pact_data.json", "README.md",
        "pact_base.safetensors",  # the base's own rounding (--rounding gptq, the default): the base it trained on
    }  # fmt: skip
    card = (adapter / "README.md").read_text()
    summary = json.loads((out / "summary.json").read_text())
    assert card.startswith("---\nlibrary_name: peft\n") and "base_model:" not in card.split("---")[1]  # local base
    assert f"| held-out accuracy after | {summary['accuracy_after']:.4g} |" in card
    assert "| PactConfig.backend | torch |" in card and "| LoRA rank (r) | 8 |" in card
    assert "`model` (a local model folder)" in card and str(root) not in card  # no path that may name the user
    model = PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(root / "model"), adapter)  # stock peft
    assert sum("lora_A" in name for name, _ in model.named_parameters()) == 2 * 7

    # what model.push_to_hub uploads for a PACT model (Hub calls stubbed): plain PEFT files + pact_config.json
    import transformers.utils.hub as hub
    from huggingface_hub import ModelCard

    pact_model = get_peft_model(LlamaForCausalLM.from_pretrained(root / "model"), PactConfig.from_pretrained(adapter))
    pushed = tmp_path / "pushed"

    class Api:
        def create_repo(self, repo_id, **kwargs):
            return type("Repo", (), {"repo_id": repo_id})()

    monkeypatch.setattr(hub, "hf_api", lambda: Api())
    monkeypatch.setattr(hub, "create_and_tag_model_card", lambda *a, **k: ModelCard("---\nlibrary_name: peft\n---\n"))
    monkeypatch.setattr(
        type(pact_model), "_upload_modified_files", lambda self, d, *a, **k: shutil.copytree(d, pushed)
    )
    pact_model.push_to_hub("someone/my-notes-adapter")
    assert {"adapter_config.json", "adapter_model.safetensors", "pact_config.json"} <= {
        p.name for p in pushed.iterdir()
    }
    PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(root / "model"), pushed)  # stock peft again


def test_model_card_names_a_hub_base_in_its_metadata(tmp_path):
    card = write_model_card(tmp_path, "HuggingFaceTB/SmolLM2-135M-Instruct", {"r": 8}, {"accuracy": 0.9}).read_text()
    assert "\nbase_model: HuggingFaceTB/SmolLM2-135M-Instruct\n" in card.split("---")[1]
    assert 'AutoModelForCausalLM.from_pretrained("HuggingFaceTB/SmolLM2-135M-Instruct")' in card
    assert "| accuracy | 0.9 |" in card


def test_output_locked_by_a_live_process_is_a_clear_error_and_a_dead_ones_lock_is_recovered(job, tmp_path, capsys):
    root, args = job
    out = tmp_path / "out"
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import importlib.util, sys, time\n"
         f"spec = importlib.util.spec_from_file_location('lock', {str(LOCK_PY)!r})\n"
         "lock = importlib.util.module_from_spec(spec); spec.loader.exec_module(lock)\n"
         f"lock.OutputDirLock({str(out)!r}).acquire(); print('locked', flush=True); time.sleep(120)"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "locked"
        assert main([*args, "--output", str(out)]) == 2
        err = capsys.readouterr().err
        assert f"is locked by a running training process (pid {holder.pid}" in err and f"kill {holder.pid}" in err
        with pytest.raises(OutputDirLockedError):
            OutputDirLock(out).acquire()
    finally:
        holder.kill()
        holder.wait()
    with OutputDirLock(out) as lock:  # the kernel dropped the dead holder's lock; its file is taken over
        assert lock.recovered_from["pid"] == holder.pid
        assert json.loads((out / ".pact.lock").read_text())["pid"] == os.getpid()
    assert not (out / ".pact.lock").exists()


def test_checkpoint_of_another_base_model_is_refused(job, tmp_path, capsys):
    root, args = job
    out = tmp_path / "out"
    assert main([*args, "--output", str(out), "--max-steps", "3"]) == 0
    other = make_tiny_model_dir(tmp_path / "other-model", seed=1)
    i = args.index("--model")
    assert main([*args[:i], "--model", str(other), *args[i + 2 :], "--output", str(out), "--max-steps", "6"]) == 2
    err = capsys.readouterr().err
    assert "refusing to resume from" in err and "a different base model" in err and "another output directory" in err
    assert main([*args, "--output", str(out), "--max-steps", "6", "--r", "4"]) == 2
    err = capsys.readouterr().err
    assert "different adapter configuration" in err and "r: checkpoint 8, this run 4" in err


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--thermal-limit", "-5"], "--thermal-limit: pact_thermal_limit_c=-5.0 is outside 30-105 degrees Celsius"),
        (["--thermal-limit", "45000"], "looks like millidegrees: use 45"),
        (["--duty-cycle", "0"], "--duty-cycle: pact_duty_cycle=0.0 must be in (0, 1]"),
    ],
)
def test_bad_background_options_are_clear_errors(extra, message, capsys):
    assert main(["finetune", "--background", "--output", "unused", *extra]) == 2
    assert message in capsys.readouterr().err


def test_background_only_options_need_background(capsys):
    assert main(["finetune", "--save-steps", "5"]) == 2
    assert "--save-steps: save_steps=5.0 sets checkpointing, which the main job does only with --background" in (
        capsys.readouterr().err
    )


def _readme_commands() -> list[str]:
    lines = (ROOT / "README.md").read_text().splitlines()
    return [line for line in lines if line.startswith("accelerate launch ") and "examples/personalize.py" in line]


def test_personalize_example_runs_under_accelerate_as_the_readme_says(job, tmp_path):
    """The README's two `accelerate launch` commands (one process; two CPU processes over gloo), on the tiny model."""
    root, _ = job
    commands = _readme_commands()
    assert len(commands) == 2 and "--num_processes 2" in commands[1]
    accelerate = str(Path(sys.executable).parent / "accelerate")
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "TRANSFORMERS_VERBOSITY": "error", "TQDM_DISABLE": "1"}
    adapters = []
    for index, command in enumerate(commands):
        out = tmp_path / f"run{index}"
        argv = command.replace("my_items.jsonl", str(root / "notes.jsonl")).replace("my-run", str(out)).split()
        argv[0] = accelerate
        argv += ["--model", str(root / "model"), "--max_steps", "4", "--per_device_train_batch_size", "2",
                 "--dtype", "float32", "--report_to", "none", "--save_strategy", "no"]  # fmt: skip
        proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        adapters.append(out / "adapter")
    one, two = adapters
    assert {p.name for p in one.iterdir()} == {p.name for p in two.iterdir()} == {
        "adapter_config.json", "adapter_model.safetensors", "pact_config.json", "pact_data.json", "README.md"
    }  # fmt: skip
    assert "| processes | 1 |" in (one / "README.md").read_text()
    assert "| processes | 2 |" in (two / "README.md").read_text()
    a, b = load_file(one / "adapter_model.safetensors"), load_file(two / "adapter_model.safetensors")
    assert {k: (v.shape, v.dtype) for k, v in a.items()} == {k: (v.shape, v.dtype) for k, v in b.items()}
    assert (one / "pact_config.json").read_text() == (two / "pact_config.json").read_text()
    configs = [json.loads((folder / "adapter_config.json").read_text()) for folder in (one, two)]
    for config in configs:  # peft writes the expanded "all-linear" set in hash order
        config["target_modules"] = sorted(config["target_modules"])
    assert configs[0] == configs[1]
