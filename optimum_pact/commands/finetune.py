"""The main job: LoRA fine-tuning of a causal LM on a user's labelled items, with an NVFP4 data-flow base.

The application face: it assembles a run from all three packages (the rest of `optimum_pact` never imports peft or
the Trainer). `pact finetune` parses its options (`arguments.py`) and calls `finetune(run)`.
"""

from __future__ import annotations

import contextlib
import json
import signal
import sys
import time
from pathlib import Path

import torch
from datasets import Dataset
from peft import get_peft_model
from transformers import DataCollatorForSeq2Seq

from trainer_callbacks import PactTrainer, TrainingInterrupted
from trainer_callbacks.lock import OutputDirLock
from trainer_callbacks.resources import peak_rss_bytes, process_seconds
from trainer_callbacks.trainer import attention_implementation, supports_padding_free

from ..dataflow import FrozenLinear
from ..errors import NoSpaceError, OptionError
from ..files import free_bytes, is_disk_full, write_text_atomic
from ..memory import pin_mmap_threshold, pinned_mmap_threshold, trim_heap
from ..precision import resolve_dtype
from .arguments import FinetuneRun
from .data import format_example, load_personal_dataset
from .data.generative import builtin_data, file_format, load_generative_dataset, prompt_ids, tokenize_generative
from .data.trained_on import TrainedOn
from .evaluation import accuracy, answer, classify, heldout_loss
from .model_folder import RUN_AGAIN, load_causal_lm, load_tokenizer, resolve_model, written_aside
from .rounded_base import MAX_ROWS, ROUNDINGS, apply_codes, gptq_base, save_codes
from .streamed_base import load_streamed_base, streams
from .summary import FinetuneSummary, write_card


def tokenize_examples(tokenizer, items: list[dict]) -> list[dict]:
    """Prompt + target + end of sequence; the loss sees the target and the end (prompt labels are -100), so the
    adapter learns to answer with one label and stop."""
    if tokenizer.eos_token_id is None:
        raise ValueError("this tokenizer has no end-of-sequence token, so a labelled answer could not end; set one")
    rows = []
    for item in items:
        prompt, target = format_example(item["text"], item["label"])
        prompt_ids = tokenizer(prompt)["input_ids"]
        target_ids = tokenizer(target, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
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


def load_data(data: str | None) -> tuple[str, list[dict], list[dict]]:
    """`(format, train items, held-out items)` of `--data`: a file, a built-in example's name, or None (the main
    job's labelled notes). Each line's problem is reported as a ValueError naming it."""
    if data is not None and not Path(data).exists() and builtin_data(data) is not None:
        data = builtin_data(data)  # a built-in example file: chat, prompt_completion, text
    form = "labelled" if data is None else file_format(data)
    if form == "labelled":
        return form, *load_personal_dataset(data)
    generative = load_generative_dataset(data)
    return form, generative.train, generative.heldout


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
    began = time.perf_counter()
    job, config, args = run.job, run.config, run.args
    form, train_items, heldout_items = load_data(job.data)  # validate the data before any slow work
    backend = config.get_backend()  # the model's one backend: a qnn that cannot start fails here, before loading
    model_path = resolve_model(job.model)
    tokenizer = load_tokenizer(model_path, job.model)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    dtype = resolve_dtype(job.dtype)
    if job.dtype == "auto" and dtype == torch.float32:
        _say("computing in float32: this CPU has no native bf16 arithmetic (emulated bf16 is many times slower)")
    if streams(config, model_path):  # no full-precision copy of the base: AQLoRA's list ranked from the checkpoint
        base, config = load_streamed_base(config, model_path, job.model, dtype)
    else:
        base = load_causal_lm(model_path, job.model, dtype=dtype)

    # padded batches for the held-out loss and the calibration batch; with pact_padding_free (the main job's default)
    # PactTrainer joins each training batch into one row instead (the same loss and gradients in fp32, no pad tokens
    # computed), where the model's attention keeps packed examples apart
    collator = DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=-100)
    if args.pact_padding_free and not supports_padding_free(base):
        _say(
            f"padding-free batches off: this model's attention ({attention_implementation(base)}) does not keep "
            "packed examples apart; training batches are padded"
        )
        args.pact_padding_free = False
    held_out = HeldOut(form, tokenizer, train_items, heldout_items, collator)
    if form == "labelled":
        train_rows = tokenize_examples(tokenizer, train_items)
    else:
        train_rows = tokenize_generative(tokenizer, train_items, form)
    rounding_began = time.perf_counter()
    codes = round_base(job, base, train_rows, model_path)  # the person's own rounding of the NVFP4 base
    rounding_seconds = time.perf_counter() - rounding_began if codes else None
    before = held_out.measure(base)
    if config.uses_calibration:
        torch.manual_seed(args.seed)
        batch = collator(train_rows[: args.per_device_train_batch_size])
        uncalibrated, config = config, config.with_calibration(base, batch)
        if config.precision_plan != uncalibrated.precision_plan:
            kept = sum(p == "fp16" for p in config.precision_plan.values())
            total, budget = len(config.precision_plan), config.precision_budget_mib
            _say(f"precision plan: {kept} of {total} linears fp16 within {budget} MiB")
        if config.protected_modules != uncalibrated.protected_modules:
            _say(f"AQLoRA: {len(config.protected_modules)} linears kept 16-bit, ranked by gradient sensitivity")
    torch.manual_seed(args.seed)
    peft_model = get_peft_model(base, config)
    codes = {name: codes[name] for name in apply_codes(peft_model, codes)}  # those that are NVFP4 in training
    trainer = PactTrainer(
        model=peft_model, args=args, train_dataset=Dataset.from_list(train_rows), data_collator=collator
    )
    frozen = [m for m in peft_model.modules() if isinstance(m, FrozenLinear)]
    backend.counts.clear()
    resume = trainer.find_checkpoint() if job.background else None
    if resume is not None:
        _say(f"resuming from {resume}")
    start = time.perf_counter()
    again = f"{RUN_AGAIN} to continue" if job.background else RUN_AGAIN
    try:
        result = trainer.train(resume_from_checkpoint=resume)
    except NoSpaceError as err:  # saving a checkpoint: the half-written one is gone, the committed ones resume the run
        raise err.with_fix(again) from err.__cause__
    train_seconds = time.perf_counter() - start
    after_training()
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

    adapter_dir = Path(job.output) / "adapter"
    extra = None
    if job.background:
        extra = {"resumed_from_step": resumable.resumed_from_step, "checkpoints": str(resumable.checkpoints_dir(args))}
        for callback in (trainer.pacer, resumable):
            if callback is not None:
                extra.update(callback.metrics())
    counts = {"frozen_linears": len(frozen), "fp16_linears": sum(m.precision == "fp16" for m in frozen)}
    compile_s = trainer.fused_cpu_ops.compile_seconds() if trainer.fused_cpu_ops is not None else None
    mapped = trainer.mapped_weights or {}
    # written aside and swapped in whole: a failed save (a full disk) leaves an earlier run's adapter as it was
    adapter_bytes = sum(p.numel() * p.element_size() for p in peft_model.parameters() if p.requires_grad)
    adapter_bytes += sum(q.nbytes for q in codes.values())  # the base's own rounding, saved beside it
    with written_aside(adapter_dir, replace=True, needs=adapter_bytes + (64 << 10), fix=again) as tmp:
        peft_model.save_pretrained(str(tmp))
        if codes:
            save_codes(tmp, codes)
        TrainedOn.of(form, train_items).save(tmp)
        # what the person is shown is the model every use of the saved adapter loads (PactModelForCausalLM: the
        # base rebuilt in the adapter's dtype with its own 16-bit linears). That model computes this one's logits
        # exactly (tests/test_use_path.py; bench_main_job scores each seed's adapter again through it in another
        # process), so it is scored here without loading the base a second time (+0.25 GiB of peak RSS)
        after = held_out.measure(peft_model)
        summary = FinetuneSummary(
            model=model_path,
            train_items=len(train_items),
            heldout_items=len(heldout_items),
            accuracy_before=before.get("accuracy"),
            accuracy_after=after.get("accuracy"),
            data_format=form,
            loss_before=before.get("loss"),
            loss_after=after.get("loss"),
            example_prompt=held_out.example_text,
            answer_before=before["answer"],
            answer_after=after["answer"],
            final_loss=losses[-1] if losses else result.training_loss,
            steps=result.global_step,
            steps_per_second=session_steps / train_seconds,
            train_seconds=train_seconds,
            wall_seconds=process_seconds() or time.perf_counter() - began,
            peak_rss_gib=peak_rss_bytes() / 2**30,
            backend=backend.name + (f" (auto: {backend.reason})" if backend.requested == "auto" else ""),
            products=products,
            memory_saver=args.pact_memory_saver,
            guarded_rows=guarded_rows,
            adapter_dir=str(adapter_dir),
            background=extra,
            dtype=str(dtype).removeprefix("torch."),
            fused_compile_s=compile_s,
            rounded_linears=len(codes),
            rounding_seconds=rounding_seconds,
            **counts,
            **mapped,
        )
        write_card(tmp, job.model, config, args, summary)
    text = json.dumps(summary.to_dict(), indent=2) + "\n"
    try:
        write_text_atomic(Path(job.output) / "summary.json", text)
    except OSError as err:
        if not is_disk_full(err):
            raise
        raise NoSpaceError(job.output, "summary.json", len(text), free_bytes(job.output), again) from err
    return summary


def round_base(job, base, rows: list[dict], checkpoint: str) -> dict:
    """`--rounding gptq`: GPTQ codes of the base's NVFP4 linears on the training items, loaded into those `base`
    holds already (a base loaded packed); {} for `--rounding nearest`."""
    if job.rounding not in ROUNDINGS:
        raise OptionError(
            "rounding",
            f"--rounding {job.rounding!r} is not one of {', '.join(ROUNDINGS)}; pass gptq "
            "(the base rounded on your training items) or nearest (the base every adapter shares)",
        )
    if job.rounding == "nearest":
        return {}
    if not pinned_mmap_threshold():  # GPTQ's 1-40 MiB temporaries go back to the system when freed, not to the heap
        pin_mmap_threshold()
    codes = gptq_base(base, [row["input_ids"] for row in rows], checkpoint)
    apply_codes(base, codes)
    trim_heap()
    _say(f"GPTQ: {len(codes)} NVFP4 linears rounded on {min(len(rows), MAX_ROWS)} training items")
    return codes


def after_training() -> None:
    """Training's frees raised glibc's mmap threshold to its ceiling (optimum_pact.memory.allocator), so every 1-32 MiB
    tensor the scoring and saving allocate next comes from the heap and stays resident once freed: at 1.5B, the final
    scoring left 1.3 GiB of free heap resident and set the run's peak. The heap's free pages go back now, and the
    threshold is pinned for the rest of the run (a pin of `--pact_mmap_threshold` stays as it is)."""
    trim_heap()
    if not pinned_mmap_threshold():
        pin_mmap_threshold()


class HeldOut:
    """What the summary reports on the held-out items: accuracy (labelled data) or loss per learned token (the
    generative formats), and one held-out item answered greedily."""

    def __init__(self, form: str, tokenizer, train: list[dict], heldout: list[dict], collator):
        self.form, self.tokenizer, self.heldout, self.collator = form, tokenizer, heldout, collator
        self.metric = "accuracy" if form == "labelled" else "loss"
        if form == "labelled":
            self.labels = sorted({item["label"] for item in train + heldout})
            self.prompt = tokenizer(format_example(heldout[0]["text"], heldout[0]["label"])[0])["input_ids"]
        else:
            self.heldout_rows = tokenize_generative(tokenizer, heldout, form)
            self.prompt = prompt_ids(tokenizer, heldout[0], form)
        self.example_text = tokenizer.decode(self.prompt, skip_special_tokens=True)

    def measure(self, model, with_answer: bool = True) -> dict:
        if self.form == "labelled":
            texts, golds = [i["text"] for i in self.heldout], [i["label"] for i in self.heldout]
            out = {"accuracy": accuracy(classify(model, self.tokenizer, texts, self.labels), golds)}
        else:
            out = {"loss": heldout_loss(model, self.heldout_rows, self.collator)}
        if with_answer:
            reply = answer(model, self.tokenizer, self.prompt, max_new_tokens=8 if self.form == "labelled" else 40)
            out["answer"] = reply.split("\n")[0] if self.form == "labelled" else reply
        return out


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"
