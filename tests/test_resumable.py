"""ResumableExecutionCallback: atomic verified checkpoints, kill -9 / SIGTERM and resume to a bit-identical adapter.

Run as a script (`python tests/test_resumable.py OUT`), this file is the training process the kill tests kill.
"""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import tiny_model
from datasets import Dataset
from peft import get_peft_model
from safetensors.torch import load_file
from transformers import Trainer, TrainerCallback, TrainingArguments

from peft_ext import PactConfig
from trainer_callbacks import (
    CorruptCheckpointError,
    PactTrainer,
    PactTrainingArguments,
    ResumableExecutionCallback,
)
from trainer_callbacks.checkpoint import MANIFEST_NAME, list_checkpoints, read_manifest

ROWS, BATCH, EPOCHS, SAVE_STEPS = 24, 4, 3, 3  # 6 steps an epoch, 18 in all: resumes land mid-epoch


def _data() -> Dataset:
    ids = torch.randint(0, 128, (ROWS, 16), generator=torch.Generator().manual_seed(1))
    return Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})


def _model(r: int = 4, seed: int = 0):
    return get_peft_model(tiny_model(seed=seed), PactConfig(r=r, lora_dropout=0.1, target_modules="all-linear"))


def _args(out, **kw) -> PactTrainingArguments:
    base = dict(
        output_dir=str(out), report_to="none", use_cpu=True, disable_tqdm=True, num_train_epochs=EPOCHS,
        per_device_train_batch_size=BATCH, learning_rate=1e-2, logging_steps=1, seed=0, save_strategy="steps",
        save_steps=SAVE_STEPS, save_total_limit=2, pact_resumable=True, pact_report_resources=False,
    )  # fmt: skip
    return PactTrainingArguments(**{**base, **kw})


def _train(out, model=None, callbacks=(), resume=True, **kw) -> PactTrainer:
    """Train (resuming from the newest verified checkpoint when there is one) and save the adapter to out/adapter."""
    model = model if model is not None else _model()
    trainer = PactTrainer(model=model, args=_args(out, **kw), train_dataset=_data(), callbacks=list(callbacks))
    trainer.train(resume_from_checkpoint=trainer.find_checkpoint() if resume else None)
    if trainer.resumable.stop_signal is None:
        model.save_pretrained(str(Path(out) / "adapter"))
    return trainer


def _adapter_bytes(out) -> bytes:
    return (Path(out) / "adapter" / "adapter_model.safetensors").read_bytes()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted run (one thread, as in the worker processes)."""
    out = tmp_path_factory.mktemp("reference")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        trainer = _train(out)
    finally:
        torch.set_num_threads(threads)
    assert trainer.state.global_step == ROWS // BATCH * EPOCHS
    return out


def test_checkpoints_hold_only_the_adapter_and_a_verified_manifest(reference):
    checkpoints = list_checkpoints(reference / "checkpoints")
    assert [c.name for c in checkpoints] == ["checkpoint-15", "checkpoint-18"]  # save_total_limit=2 kept
    assert not list(reference.glob("checkpoint-*"))  # nothing left in the Trainer's staging place
    latest = checkpoints[-1]
    manifest = read_manifest(latest)
    assert manifest["global_step"] == 18 and manifest["data_position"]["samples_seen"] == 18 * BATCH
    assert set(manifest["files"]) >= {"adapter_model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth"}
    weights = load_file(latest / "adapter_model.safetensors")
    assert weights and all("lora_" in name for name in weights)  # no frozen base weight
    base_bytes = sum(t.numel() * t.element_size() for t in tiny_model().state_dict().values())
    ckpt_bytes = sum(f["bytes"] for f in manifest["files"].values())
    adapter = manifest["files"]["adapter_model.safetensors"]["bytes"]
    kib = f"{ckpt_bytes / 1024:.1f} KiB (adapter {adapter / 1024:.1f} KiB) vs base weights {base_bytes / 1024:.1f} KiB"
    print(f"\ncheckpoint size: {kib}")
    assert adapter < base_bytes / 5


def test_truncated_latest_checkpoint_is_detected_and_the_previous_one_used(tmp_path, reference, caplog):
    stop = _StopAt(14)
    _train(tmp_path, callbacks=[stop])  # interrupted on "SIGTERM" at step 14: checkpoints 12 and 14 committed
    latest = tmp_path / "checkpoints" / "checkpoint-14"
    adapter = latest / "adapter_model.safetensors"
    adapter.write_bytes(adapter.read_bytes()[: adapter.stat().st_size // 2])  # a torn write
    with pytest.raises(CorruptCheckpointError, match="adapter_model.safetensors has"):
        read_manifest(latest)
    explicit = PactTrainer(model=_model(), args=_args(tmp_path), train_dataset=_data())
    with pytest.raises(CorruptCheckpointError, match="checkpoint-14: adapter_model.safetensors has"):
        explicit.train(resume_from_checkpoint=str(latest))  # a given path is verified too
    with caplog.at_level(logging.WARNING):
        trainer = PactTrainer(model=_model(), args=_args(tmp_path), train_dataset=_data())
        found = trainer.find_checkpoint()
    assert found == str(tmp_path / "checkpoints" / "checkpoint-12")
    assert "corrupt checkpoint skipped" in caplog.text and "checkpoint-14" in caplog.text
    assert (tmp_path / "checkpoints" / "checkpoint-14.corrupt").is_dir()
    _train(tmp_path)
    assert _adapter_bytes(tmp_path) == _adapter_bytes(reference)


class _StopAt(TrainerCallback):
    """Sends this process SIGTERM during step `step`, like a phone's OS closing the app."""

    def __init__(self, step: int):
        self.step = step

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step + 1 == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


def test_sigterm_saves_then_stops_and_the_resumed_run_matches(tmp_path, reference):
    previous = signal.getsignal(signal.SIGTERM)
    trainer = _train(tmp_path, callbacks=[_StopAt(8)])
    assert signal.getsignal(signal.SIGTERM) == previous  # handlers restored
    assert trainer.resumable.stop_signal == signal.SIGTERM and trainer.state.global_step == 8
    manifest = read_manifest(tmp_path / "checkpoints" / "checkpoint-8")
    assert manifest["signal"] == "SIGTERM" and not (tmp_path / "adapter").exists()
    resumed = _train(tmp_path)
    assert resumed.resumable.resumed_from_step == 8
    assert _adapter_bytes(tmp_path) == _adapter_bytes(reference)


def test_time_based_checkpoints(tmp_path):
    now = [0.0]

    class Tick(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            now[0] += 20.0  # each step "takes" 20 s

    resumable = ResumableExecutionCallback(save_every_minutes=1, clock=lambda: now[0])
    args = TrainingArguments(
        output_dir=str(tmp_path), report_to="none", use_cpu=True, disable_tqdm=True, max_steps=7,
        per_device_train_batch_size=BATCH, save_strategy="no",
    )  # fmt: skip
    trainer = Trainer(model=_model(), args=args, train_dataset=_data(), callbacks=[Tick, resumable])
    trainer.train()  # the stock Trainer: checkpoints at 60 s and 120 s (steps 3 and 6), none at the end
    assert [c.name for c in list_checkpoints(tmp_path / "checkpoints")] == ["checkpoint-3", "checkpoint-6"]


def test_checkpoint_of_another_base_or_config_is_refused(tmp_path):
    _train(tmp_path, callbacks=[_StopAt(3)])
    other_base = PactTrainer(model=_model(seed=1), args=_args(tmp_path), train_dataset=_data())
    with pytest.raises(ValueError, match="refusing to resume .*different base model"):
        other_base.find_checkpoint()
    other_config = PactTrainer(model=_model(r=8), args=_args(tmp_path), train_dataset=_data())
    with pytest.raises(ValueError, match=r"different adapter configuration.*\.r: checkpoint 4, this run 8"):
        other_config.train(resume_from_checkpoint=True)
    same = PactTrainer(model=_model(), args=_args(tmp_path), train_dataset=_data())
    assert same.find_checkpoint().endswith("checkpoint-3")


def test_unfinished_checkpoint_is_never_used(tmp_path, caplog):
    _train(tmp_path, callbacks=[_StopAt(3)])
    # a killed save: the Trainer's folder without a manifest (staging), and a committed one missing its manifest
    staging = tmp_path / "checkpoint-6"
    (staging / "junk").mkdir(parents=True)
    (staging / ".pact-staging").touch()
    torn = tmp_path / "checkpoints" / "checkpoint-9"
    torn.mkdir()
    (torn / "trainer_state.json").write_text("{}")
    with caplog.at_level(logging.INFO, logger="trainer_callbacks"):
        trainer = _train(tmp_path)
    assert trainer.resumable.resumed_from_step == 3
    assert "no pact_checkpoint.json (not committed)" in caplog.text
    assert (tmp_path / "checkpoints" / "checkpoint-9.corrupt" / "trainer_state.json").read_text() == "{}"
    assert f"removing {staging}, a checkpoint left unfinished" in caplog.text


def test_bad_options_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="pact_save_minutes=-1 must be a positive number"):
        _args(tmp_path, pact_save_minutes=-1)
    with pytest.raises(ValueError, match="keep=0 must be a positive number"):
        ResumableExecutionCallback(keep=0)
    with pytest.raises(ValueError, match="load_best_model_at_end=True does not work with pact_resumable"):
        _args(tmp_path, load_best_model_at_end=True, eval_strategy="steps")


# ---- kill -9 at random points, in real processes ----


def _worker(out: str) -> None:
    """The killed process: trains with checkpoints every 3 steps, printing each finished step."""
    logging.disable(logging.WARNING)
    torch.set_num_threads(1)

    class Say(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            print(f"step {state.global_step}", flush=True)

    trainer = _train(out, callbacks=[Say()])
    print(f"done {trainer.state.global_step} resumed-from {trainer.resumable.resumed_from_step}", flush=True)


def _launch(out: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "TRANSFORMERS_VERBOSITY": "error", "TQDM_DISABLE": "1"}
    return subprocess.Popen(
        [sys.executable, __file__, str(out)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env
    )


def _kill_after(out: Path, steps: int, delay: float) -> tuple[int, str]:
    """Run the worker and kill -9 it `delay` s after it finished `steps` steps of this run; returns the first step
    this run finished and what happened.

    Fails unless the kill really lands mid-run: the process must still be running (killed by the signal, no "done").
    """
    proc = _launch(out)
    try:
        seen = []
        for line in proc.stdout:
            if line.startswith("step "):
                seen.append(int(line.split()[1]))
                if len(seen) == steps:
                    time.sleep(delay)
                    proc.kill()
                    rest = proc.stdout.read()
                    proc.wait()
                    assert proc.returncode == -signal.SIGKILL and "done" not in rest, (proc.returncode, rest)
                    return seen[0], f"started at step {seen[0]}, killed {delay * 1000:.0f} ms after step {seen[-1]}"
        raise AssertionError(f"the run ended (rc {proc.wait()}) before {steps} steps: this trial killed nothing")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _kill_resume_trials(tmp_path: Path, reference: Path, chains: int, kills: int, seed: int) -> None:
    """`chains` runs, each killed with SIGKILL `kills` times at random points and resumed each time, then run to the
    end; the final adapter must be the reference's. A kill lands 4 or 5 steps into a run plus up to 30 ms (mid-step,
    or mid-checkpoint: checkpoints follow every 3rd step), so each run has committed a checkpoint before it dies and
    is still running when it is killed (18 steps in all); every run must start from the newest committed one."""
    rng = random.Random(seed)
    report, corrupt = [], 0
    for chain in range(chains):
        out = tmp_path / f"chain{chain}"
        for _ in range(kills):
            committed = [int(c.name.split("-")[1]) for c in list_checkpoints(out / "checkpoints")]
            steps_in = rng.choice((4, 5)) if max(committed, default=0) + 5 <= 15 else 4  # never past step 17
            started, what = _kill_after(out, steps_in, rng.uniform(0, 0.03))
            assert started == (max(committed) + 1 if committed else 1), (what, committed)  # resumed, or fresh
            for folder in list_checkpoints(out / "checkpoints"):
                try:
                    read_manifest(folder)
                except CorruptCheckpointError:
                    corrupt += 1
            steps = [int(c.name.split("-")[1]) for c in list_checkpoints(out / "checkpoints")]
            report.append(f"chain {chain}: {what}; committed checkpoints {steps}")
        final = _launch(out)
        stdout, _ = final.communicate(timeout=300)
        assert final.returncode == 0, stdout[-2000:]
        report.append(f"chain {chain}: {stdout.strip().splitlines()[-1]}")
        resumed_from = int(stdout.strip().splitlines()[-1].split()[-1])
        assert 0 < resumed_from < 18, "\n".join(report)  # the last run continued from a checkpoint before the end
        assert _adapter_bytes(out) == _adapter_bytes(reference), "\n".join(report)
        assert not list((out / "checkpoints").glob("*.corrupt"))
    print("\n" + "\n".join(report) + f"\ncorrupt checkpoints: {corrupt}; final adapters bit-identical: yes")
    assert corrupt == 0


def test_kill_9_at_random_points_then_resume_gives_the_same_adapter(tmp_path, reference):
    _kill_resume_trials(tmp_path, reference, chains=1, kills=3, seed=20240611)


@pytest.mark.slow
def test_kill_9_many_trials(tmp_path, reference):
    _kill_resume_trials(tmp_path, reference, chains=5, kills=3, seed=7)


def test_manifest_lists_every_file_with_its_size(tmp_path):
    """The manifest names every file of the checkpoint, with sizes that match what is on disk."""
    _train(tmp_path, callbacks=[_StopAt(3)])
    folder = tmp_path / "checkpoints" / "checkpoint-3"
    manifest = json.loads((folder / MANIFEST_NAME).read_text())
    on_disk = {p.name: p.stat().st_size for p in folder.iterdir() if p.name != MANIFEST_NAME}
    assert {name: f["bytes"] for name, f in manifest["files"].items()} == on_disk


if __name__ == "__main__":
    _worker(sys.argv[1])
