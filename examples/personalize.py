"""Fine-tune a LoRA adapter on your own labelled notes, on your own machine: PactConfig + PactTrainer.

Copy this script and change what you like. It runs as a plain script or under accelerate:

    accelerate launch examples/personalize.py --data my_items.jsonl --output_dir my-run
    accelerate launch --cpu --num_processes 2 examples/personalize.py --data my_items.jsonl --output_dir my-run

`--data` is JSON Lines, one {"text": ..., "label": ...} per line (as for `pact finetune`). Every TrainingArguments
option and every PACT option (`--pact_*`) is a flag: e.g. `--pact_thermal_pacing --pact_resumable --save_strategy steps
--save_steps 20` paces by temperature, checkpoints every 20 steps and on SIGTERM, and continues when re-run. The
adapter lands in `<output_dir>/adapter`: plain PEFT files, `pact_config.json` and a model card (README.md).
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
from datasets import Dataset
from peft import get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer, DataCollatorForSeq2Seq, HfArgumentParser

from optimum_pact.commands.data import load_personal_dataset
from optimum_pact.commands.data.trained_on import TrainedOn
from optimum_pact.commands.default_model import DEFAULT_MODEL_HUB_ID, DEFAULT_MODEL_NOTE
from optimum_pact.commands.evaluation import accuracy, classify
from optimum_pact.commands.finetune import tokenize_examples
from optimum_pact.commands.model_folder import resolve_model
from peft_ext import PactConfig
from trainer_callbacks import PactTrainer, PactTrainingArguments
from trainer_callbacks.model_card import write_model_card


@dataclass
class ScriptArguments:
    model: str | None = field(
        default=None, metadata={"help": "Model folder or Hub id; default: SmolLM2-135M-Instruct (fetched once)."}
    )
    data: str | None = field(default=None, metadata={"help": "JSONL of {text, label} items; default: built-in notes."})
    r: int = field(default=8, metadata={"help": "LoRA rank."})
    lora_alpha: int = field(default=16, metadata={"help": "LoRA alpha."})
    dtype: str = field(default="bfloat16", metadata={"help": "Compute dtype of the base: bfloat16 or float32."})


def main(argv: list[str] | None = None) -> int:
    parser = HfArgumentParser((ScriptArguments, PactTrainingArguments))
    # the defaults of `pact finetune`; any flag overrides them
    parser.set_defaults(
        learning_rate=2e-3, num_train_epochs=2, per_device_train_batch_size=8, warmup_steps=5, logging_steps=5,
        save_strategy="no", report_to="none", output_dir="pact-output",
    )  # fmt: skip
    script, args = parser.parse_args_into_dataclasses(args=argv)
    if script.dtype not in ("bfloat16", "float32"):
        raise ValueError(f"--dtype {script.dtype!r} is not supported; use bfloat16 or float32.")

    train_items, heldout_items = load_personal_dataset(script.data)
    model_path = resolve_model(script.model)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, script.dtype))
    labels = sorted({item["label"] for item in train_items + heldout_items})
    texts, golds = [i["text"] for i in heldout_items], [i["label"] for i in heldout_items]
    main_process = args.process_index == 0
    before = accuracy(classify(base, tokenizer, texts, labels), golds) if main_process else None

    torch.manual_seed(args.seed)
    # the model-side --pact_* flags (backend, AQLoRA, ...) are PactConfig's options
    lora = {"r": script.r, "lora_alpha": script.lora_alpha, "target_modules": "all-linear"}
    pact_config = PactConfig(**lora, **dataclasses.asdict(args.pact_options()))
    model = get_peft_model(base, pact_config)
    trainer = PactTrainer(
        model=model,
        args=args,
        train_dataset=Dataset.from_list(tokenize_examples(tokenizer, train_items)),
        data_collator=DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=-100),
    )
    # with --pact_resumable, re-running the same command continues from the newest verified checkpoint
    result = trainer.train(resume_from_checkpoint=trainer.find_checkpoint() if trainer.resumable else None)
    if trainer.resumable is not None and trainer.resumable.stop_signal is not None:
        print(f"stopped at step {result.global_step} after a checkpoint; run the same command to continue")
        return 128 + trainer.resumable.stop_signal

    adapter_dir = Path(args.output_dir) / "adapter"
    if main_process:
        model.save_pretrained(str(adapter_dir))  # plain PEFT files + pact_config.json
        TrainedOn.of("labelled", train_items).save(adapter_dir)  # so `pact generate` prompts and stops as trained
        after = accuracy(classify(model, tokenizer, texts, labels), golds)
        losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
        settings = {"LoRA rank (r)": script.r, "lora_alpha": script.lora_alpha, "target_modules": "all-linear"}
        settings.update({f"PactConfig.{k}": v for k, v in pact_config.pact_dict().items()})
        settings.update({"processes": args.world_size, "learning rate": args.learning_rate, "seed": args.seed})
        metrics = {
            "held-out accuracy before": round(before, 4),
            "held-out accuracy after": round(after, 4),
            "final training loss": round(losses[-1] if losses else result.training_loss, 4),
            "steps": result.global_step,
        }
        base_name, note = (script.model, None) if script.model else (DEFAULT_MODEL_HUB_ID, DEFAULT_MODEL_NOTE)
        write_model_card(adapter_dir, base_name, settings, metrics, base_model_note=note)
        print(f"held-out accuracy {before:.1%} -> {after:.1%}; adapter in {adapter_dir}")
    trainer.accelerator.wait_for_everyone()
    return 0


if __name__ == "__main__":
    sys.exit(main())
