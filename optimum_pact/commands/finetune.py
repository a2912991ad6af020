"""The main job: LoRA fine-tuning of a causal LM on a user's labelled items, with an NVFP4 data-flow base.

The application face: it assembles a run from all three packages (the rest of `optimum_pact` never imports peft or
the Trainer). `pact finetune` parses its options (`arguments.py`) and calls `finetune(run)`.
"""

from __future__ import annotations

import contextlib
import json
import re
import signal
import sys
import time
from pathlib import Path

import torch
from datasets import Dataset
from peft import get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer, DataCollatorForSeq2Seq

from trainer_callbacks import PactTrainer, TrainingInterrupted
from trainer_callbacks.lock import OutputDirLock
from trainer_callbacks.resources import peak_rss_bytes

from ..dataflow import FrozenLinear
from .arguments import FinetuneRun
from .data import format_example, load_personal_dataset
from .evaluation import accuracy, classify
from .summary import FinetuneSummary, write_card


def resolve_model(model: str | None) -> str:
    """The local folder (or Hub id) to load; the embedded default model when `model` is None."""
    if model is None:
        from .default_model import ensure_default_model

        return str(ensure_default_model())
    path = Path(model).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"--model {model!r}: {path} has no config.json; pass a folder written by save_pretrained."
            )
        return str(path)
    if model.startswith((".", "/", "~")) or not re.fullmatch(r"[\w.-]+/[\w.-]+", model):
        raise FileNotFoundError(f"--model {model!r} does not exist; pass an existing model folder or a Hub id.")
    return model  # a Hub id such as "HuggingFaceTB/SmolLM2-135M-Instruct"


def tokenize_examples(tokenizer, items: list[dict]) -> list[dict]:
    """Prompt + target tokens; the loss sees only the target (prompt labels are -100)."""
    rows = []
    for item in items:
        prompt, target = format_example(item["text"], item["label"])
        prompt_ids = tokenizer(prompt)["input_ids"]
        target_ids = tokenizer(target, add_special_tokens=False)["input_ids"]
        rows.append(
            {
                "input_ids": prompt_ids + target_ids,
                "attention_mask": [1] * (len(prompt_ids) + len(target_ids)),
                "labels": [-100] * len(prompt_ids) + target_ids,
            }
        )
    return rows


def _say(message: str) -> None:
    print(f"[optimum-pact] {message}", file=sys.stderr, flush=True)


def finetune(run: FinetuneRun) -> FinetuneSummary:
    """Fine-tune a LoRA adapter with PACT and return the summary (also written to `OUTPUT/summary.json`).

    With `--background` one run holds `OUTPUT` (a lock file; a dead process's lock is taken over), checkpoints
    follow `run.args` (pact_resumable), a SIGTERM/SIGINT saves and raises `TrainingInterrupted`, and running the
    same command again continues from the newest valid checkpoint.
    """
    job = run.job
    lock = OutputDirLock(job.output) if job.background else contextlib.nullcontext()
    with lock:
        return _finetune(run)


def _finetune(run: FinetuneRun) -> FinetuneSummary:
    job, config, args = run.job, run.config, run.args
    train_items, heldout_items = load_personal_dataset(job.data)  # validate the data before any slow work
    backend = config.get_backend()  # the model's one backend: a qnn that cannot start fails here, before loading
    model_path = resolve_model(job.model)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    try:
        base = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, job.dtype))
    except OSError as err:
        raise FileNotFoundError(f"--model {job.model!r} could not be loaded: {err}") from err

    labels = sorted({item["label"] for item in train_items + heldout_items})
    texts, golds = [i["text"] for i in heldout_items], [i["label"] for i in heldout_items]
    accuracy_before = accuracy(classify(base, tokenizer, texts, labels), golds)

    train_rows = tokenize_examples(tokenizer, train_items)
    collator = DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=-100)
    if config.precision_budget_mib is not None and config.precision_plan is None:
        torch.manual_seed(args.seed)
        batch = collator(train_rows[: args.per_device_train_batch_size])
        config = config.with_precision_plan(base, batch, config.precision_budget_mib)
        kept = sum(p == "fp16" for p in config.precision_plan.values())
        total, budget = len(config.precision_plan), config.precision_budget_mib
        _say(f"precision plan: {kept} of {total} linears fp16 within {budget} MiB")
    torch.manual_seed(args.seed)
    peft_model = get_peft_model(base, config)
    trainer = PactTrainer(
        model=peft_model, args=args, train_dataset=Dataset.from_list(train_rows), data_collator=collator
    )
    frozen = [m for m in peft_model.modules() if isinstance(m, FrozenLinear)]
    backend.counts.clear()
    resume = trainer.find_checkpoint() if job.background else None
    if resume is not None:
        _say(f"resuming from {resume}")
    start = time.perf_counter()
    result = trainer.train(resume_from_checkpoint=resume)
    train_seconds = time.perf_counter() - start
    resumable = trainer.resumable
    if resumable is not None and resumable.stop_signal is not None:
        raise TrainingInterrupted(
            f"{signal_name(resumable.stop_signal)} received: stopped at step {trainer.state.global_step} after "
            f"saving {resumable.last_checkpoint}; run the same command again to continue.",
            resumable.stop_signal,
        )
    products = {backend.name: backend.counts["forward"] + backend.counts["input_grad"]}  # training's, not evaluation's
    guarded_rows = backend.counts["guarded_rows"]
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    session_steps = result.global_step - (resumable.resumed_from_step if resumable is not None else 0)

    accuracy_after = accuracy(classify(peft_model, tokenizer, texts, labels), golds)
    adapter_dir = Path(job.output) / "adapter"
    peft_model.save_pretrained(str(adapter_dir))
    extra = None
    if job.background:
        extra = {"resumed_from_step": resumable.resumed_from_step, "checkpoints": str(resumable.checkpoints_dir(args))}
        for callback in (trainer.pacer, resumable):
            if callback is not None:
                extra.update(callback.metrics())
    summary = FinetuneSummary(
        model=model_path,
        train_items=len(train_items),
        heldout_items=len(heldout_items),
        accuracy_before=accuracy_before,
        accuracy_after=accuracy_after,
        final_loss=losses[-1] if losses else result.training_loss,
        steps=result.global_step,
        steps_per_second=session_steps / train_seconds,
        train_seconds=train_seconds,
        peak_rss_gib=peak_rss_bytes() / 2**30,
        frozen_linears=len(frozen),
        backend=backend.name + (f" (auto: {backend.reason})" if backend.requested == "auto" else ""),
        products=products,
        fp16_linears=sum(m.precision == "fp16" for m in frozen),
        memory_saver=args.pact_memory_saver,
        guarded_rows=guarded_rows,
        adapter_dir=str(adapter_dir),
        background=extra,
    )
    write_card(adapter_dir, job.model, config, args, summary)
    (Path(job.output) / "summary.json").write_text(json.dumps(summary.to_dict(), indent=2) + "\n")
    return summary


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"
