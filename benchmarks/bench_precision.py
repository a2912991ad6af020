"""Precision by gradient sensitivity on the main job's model and data, measured in one run.

SmolLM2-135M-Instruct (real weights, bf16) and the built-in notes. The probe (`PactConfig.with_precision_plan`)
measures, per linear, how much NVFP4 instead of 16-bit weights moves the layer's input gradient and all adapter
gradients on one calibration batch; the plan keeps the most sensitive linears fp16 within `--budget-mib`. Then the
same short fine-tune (same seed, batches and learning rate) runs under the plan, all-NVFP4 and all-fp16, and
reports the final loss (mean of the last 5 steps) and the held-out accuracy of each.

Prints a per-layer table (precision, adapter-gradient change, input-gradient error) and one JSON line.

    python benchmarks/bench_precision.py [--budget-mib 16] [--steps 40]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time


def finetune_losses(model_path, plan, rows, collator, steps, batch_size, seed):
    import torch
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from peft_ext import PactConfig

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16)
    model = get_peft_model(base, PactConfig(r=8, lora_alpha=16, target_modules="all-linear", precision_plan=plan))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-3)
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed)).tolist()
    losses = []
    for step in range(steps):
        picks = [order[(step * batch_size + i) % len(order)] for i in range(batch_size)]
        loss = model(**collator([rows[i] for i in picks])).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return model, losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget-mib", type=float, default=16.0)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, DataCollatorForSeq2Seq

    from optimum_pact.commands.data import load_personal_dataset
    from optimum_pact.commands.default_model import ensure_default_model
    from optimum_pact.commands.evaluation import accuracy, classify
    from optimum_pact.commands.finetune import tokenize_examples
    from peft_ext import PactConfig
    from peft_ext.precision import probe_precision

    torch.set_num_threads(2)
    model_path = str(ensure_default_model())
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    train, heldout = load_personal_dataset()
    rows = tokenize_examples(tokenizer, train)
    collator = DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=-100)
    calibration = collator(rows[: args.batch_size])

    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16)
    start = time.perf_counter()
    config = PactConfig(r=8, lora_alpha=16, target_modules="all-linear")
    sens = probe_precision(base, calibration, config)
    probe_s = time.perf_counter() - start
    from optimum_pact.precision import plan_precision

    plans = {
        "plan": plan_precision(sens, args.budget_mib),
        "all_nvfp4": {s.name: "nvfp4" for s in sens},
        "all_fp16": {s.name: "fp16" for s in sens},
    }
    print(f"{'layer':<44} {'precision':>9} {'adapter-grad change':>20} {'input-grad error':>17}")
    for s in sorted(sens, key=lambda s: -s.score):
        print(f"{s.name:<44} {plans['plan'][s.name]:>9} {s.adapter_grad_change:>20.5f} {s.input_grad_error:>17.5f}")
    del base

    labels = sorted({i["label"] for i in train + heldout})
    texts, golds = [i["text"] for i in heldout], [i["label"] for i in heldout]
    results = {}
    for arm, plan in plans.items():
        model, losses = finetune_losses(
            model_path, plan, rows, collator, args.steps, args.batch_size, args.seed
        )  # fmt: skip
        premium = sum(s.fp16_premium_bytes for s in sens if plan[s.name] == "fp16") / 2**20
        results[arm] = {
            "fp16_layers": sum(p == "fp16" for p in plan.values()),
            "fp16_premium_mib": round(premium, 2),
            "final_loss": round(statistics.mean(losses[-5:]), 4),
            "heldout_accuracy": round(accuracy(classify(model, tokenizer, texts, labels), golds), 4),
        }
    scores = [s.score for s in sens]
    print(
        json.dumps(
            {
                "bench": "precision",
                "layers": len(sens),
                "budget_mib": args.budget_mib,
                "probe_s": round(probe_s, 1),
                "sensitivity_max": round(max(scores), 5),
                "sensitivity_median": round(statistics.median(scores), 5),
                "steps": args.steps,
                **results,
                "plan_loss_gap_closed": _gap_closed(results),
            }
        )
    )


def _gap_closed(results) -> float | None:
    """How much of the all-NVFP4 -> all-fp16 loss gap the plan closes (None when the gap is ~0)."""
    gap = results["all_nvfp4"]["final_loss"] - results["all_fp16"]["final_loss"]
    if math.isclose(gap, 0.0, abs_tol=1e-4):
        return None
    return round((results["all_nvfp4"]["final_loss"] - results["plan"]["final_loss"]) / gap, 3)


if __name__ == "__main__":
    main()
