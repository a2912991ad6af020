"""The main job: LoRA fine-tuning of a causal LM on a user's labelled items, with an NVFP4 data-flow base.

This is the application face: it assembles a run from all three packages (the core of `optimum_pact` never
imports peft or the Trainer). `pact finetune` calls `finetune()`.
"""

from __future__ import annotations

import json
import logging
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)


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

    def render(self) -> str:
        rows = [
            ("model", self.model),
            ("data", f"{self.train_items} train / {self.heldout_items} held-out items"),
            ("held-out accuracy", f"{self.accuracy_before:.1%} -> {self.accuracy_after:.1%}"),
            ("final training loss", f"{self.final_loss:.4f}"),
            ("steps", f"{self.steps} in {self.train_seconds:.1f} s ({self.steps_per_second:.2f} steps/s)"),
            ("peak memory (RSS)", f"{self.peak_rss_gib:.2f} GiB"),
            ("frozen NVFP4 linears", f"{self.frozen_linears} on the {self.backend} backend"),
            ("adapter", self.adapter_dir),
        ]
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


def finetune(
    model: str | None = None,
    data: str | None = None,
    output: str = "pact-output",
    backend: str = "torch",
    r: int = 8,
    lora_alpha: int = 16,
    learning_rate: float = 2e-3,
    epochs: float = 2.0,
    max_steps: int = -1,
    batch_size: int = 8,
    dtype: str = "bfloat16",
    seed: int = 0,
) -> FinetuneSummary:
    """Fine-tune a LoRA adapter with PACT and return the summary (also written to `output/summary.json`)."""
    from datasets import Dataset
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer, DataCollatorForSeq2Seq

    from peft_ext import PactConfig
    from trainer_callbacks import PactTrainer, PactTrainingArguments, peak_rss_bytes

    from .data import load_personal_dataset
    from .dataflow import FrozenLinear
    from .evaluation import accuracy, classify

    if dtype not in ("bfloat16", "float32"):
        raise ValueError(f"--dtype {dtype!r} is not supported; use 'bfloat16' or 'float32'.")
    train_items, heldout_items = load_personal_dataset(data)  # validate the data before any slow work
    pact_config = PactConfig(r=r, lora_alpha=lora_alpha, target_modules="all-linear", backend=backend)
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

    torch.manual_seed(seed)
    peft_model = get_peft_model(base, pact_config)
    args = PactTrainingArguments(
        output_dir=str(Path(output) / "trainer"),
        per_device_train_batch_size=batch_size,
        num_train_epochs=epochs,
        max_steps=max_steps,
        learning_rate=learning_rate,
        warmup_steps=5,
        logging_steps=5,
        save_strategy="no",
        report_to="none",
        use_cpu=not torch.cuda.is_available(),
        seed=seed,
    )
    trainer = PactTrainer(
        model=peft_model,
        args=args,
        train_dataset=Dataset.from_list(tokenize_examples(tokenizer, train_items)),
        data_collator=DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=-100),
    )
    start = time.perf_counter()
    result = trainer.train()
    train_seconds = time.perf_counter() - start
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]

    accuracy_after = accuracy(classify(peft_model, tokenizer, texts, labels), golds)
    adapter_dir = Path(output) / "adapter"
    peft_model.save_pretrained(str(adapter_dir))
    summary = FinetuneSummary(
        model=model_path,
        train_items=len(train_items),
        heldout_items=len(heldout_items),
        accuracy_before=accuracy_before,
        accuracy_after=accuracy_after,
        final_loss=losses[-1] if losses else result.training_loss,
        steps=result.global_step,
        steps_per_second=result.global_step / train_seconds,
        train_seconds=train_seconds,
        peak_rss_gib=peak_rss_bytes() / 2**30,
        frozen_linears=sum(isinstance(m, FrozenLinear) for m in peft_model.modules()),
        backend=backend,
        adapter_dir=str(adapter_dir),
    )
    (Path(output) / "summary.json").write_text(json.dumps(asdict(summary), indent=2) + "\n")
    return summary
