"""`bench_memory.py --quality`: the memory savers' quality guard, SmolLM2 fine-tuned with the full stack and with
the baseline (same batches), held-out accuracy before / after and the loss curves, over seeds."""

from __future__ import annotations

import statistics
import sys
import time

QUALITY_ARMS = {"baseline": None, "pact": "none", "exact": "exact", "full": "full"}  # MemorySavers preset per arm


def run_quality(
    steps: int, batch_size: int, lr: float, out_prefix: str, seed: int = 0, arms=("baseline", "full")
) -> dict:
    """Fine-tune SmolLM2 on the built-in data twice (peft LoRA fp32 vs PACT + MemorySavers 'full'), same batches.

    Held-out accuracy (the main job's metric: the most likely label) before and after, and the training loss of
    every step (the full-stack loss is the subset-softmax loss, a lower bound of the full cross-entropy, so the
    curves differ in level by construction; the accuracies are the comparison). Writes `<out_prefix>.png` when
    matplotlib is installed, and always `<out_prefix>.csv`.
    """
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from optimum_pact.commands.data import load_personal_dataset
    from optimum_pact.commands.default_model import ensure_default_model
    from optimum_pact.commands.evaluation import accuracy, classify
    from optimum_pact.commands.finetune import tokenize_examples
    from optimum_pact.memory import MemorySavers
    from peft_ext import PactConfig

    torch.set_num_threads(2)
    path = ensure_default_model()
    tokenizer = AutoTokenizer.from_pretrained(path)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    train, heldout = load_personal_dataset()
    rows = tokenize_examples(tokenizer, train)
    texts, golds = [i["text"] for i in heldout], [i["label"] for i in heldout]
    labels = sorted({i["label"] for i in train + heldout})
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed)).tolist()

    def batch_at(step: int):
        picked = [rows[order[(step * batch_size + i) % len(rows)]] for i in range(batch_size)]
        width = max(len(r["input_ids"]) for r in picked)
        ids = torch.full((batch_size, width), pad)
        mask, lab = torch.zeros_like(ids), torch.full_like(ids, -100)
        for i, r in enumerate(picked):  # right padding, as DataCollatorForSeq2Seq
            n = len(r["input_ids"])
            ids[i, :n], mask[i, :n], lab[i, :n] = torch.tensor(r["input_ids"]), 1, torch.tensor(r["labels"])
        return ids, mask, lab

    results, curves = {}, {}
    for arm in arms:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
        before = accuracy(classify(model, tokenizer, texts, labels), golds)
        lora = dict(r=16, lora_alpha=32, target_modules="all-linear")
        preset = QUALITY_ARMS[arm]
        model = get_peft_model(
            model, LoraConfig(**lora) if preset is None else PactConfig(**lora, backend_options={"tile_size": 256})
        )
        savers = MemorySavers.from_preset(model, preset) if preset not in (None, "none") else None
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
        model.train()
        losses, start = [], time.perf_counter()
        for step_index in range(steps):
            ids, mask, lab = batch_at(step_index)
            loss = model(input_ids=ids, attention_mask=mask, labels=lab).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
            print(f"quality {arm} step {step_index + 1}/{steps} loss {losses[-1]:.4f}", file=sys.stderr)
        train_s = time.perf_counter() - start
        after = accuracy(classify(model, tokenizer, texts, labels), golds)
        if savers is not None:
            savers.close()
        results[arm] = {"accuracy_before": before, "accuracy_after": after, "train_s": train_s}
        curves[arm] = losses
    with open(out_prefix + ".csv", "w") as f:
        f.write("step," + ",".join(f"{arm}_loss" for arm in arms) + "\n")
        f.writelines(f"{i + 1}," + ",".join(str(c) for c in row) + "\n" for i, row in enumerate(zip(*curves.values())))
    plot = _plot(curves, results, out_prefix + ".png")
    gap = results[arms[-1]]["accuracy_after"] - results[arms[0]]["accuracy_after"]
    return {"bench": "memory_quality", "steps": steps, "batch": batch_size, "lr": lr, "heldout": len(heldout),
            "results": results, "accuracy_gap_points": 100 * gap, "within_1_point": abs(gap) <= 0.01,
            "curves_csv": out_prefix + ".csv", "plot": plot}  # fmt: skip


def _plot(curves: dict, results: dict, path: str) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no PNG (the curves are in the CSV)", file=sys.stderr)
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    names = {
        "baseline": "peft LoRA fp32, full softmax",
        "pact": "PACT NVFP4, no savers",
        "exact": "PACT + savers 'exact'",
        "full": "PACT full stack, top-1000 softmax",
    }
    for arm, name in ((arm, names[arm]) for arm in curves):
        acc = results[arm]["accuracy_after"]
        ax.plot(range(1, len(curves[arm]) + 1), curves[arm], label=f"{name} (held-out acc {acc:.1%})")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title("SmolLM2-135M on the built-in data: full stack vs baseline")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def quality_guard(steps: int, batch_size: int, lr: float, out_prefix: str, seeds: int, arms) -> dict:
    """`run_quality` once per seed (`<out_prefix>-seed<N>.csv / .png`); the accuracy gap judged on its mean."""
    runs = [run_quality(steps, batch_size, lr, f"{out_prefix}-seed{seed}", seed, arms) for seed in range(seeds)]
    gaps = [r["accuracy_gap_points"] for r in runs]
    mean_gap = statistics.mean(gaps)
    return {
        "bench": "memory_quality",
        "seeds": seeds,
        "accuracy_gap_points": gaps,
        "mean_gap_points": mean_gap,
        "sd_gap_points": statistics.stdev(gaps) if len(gaps) > 1 else None,
        "within_1_point": abs(mean_gap) <= 1.0,
        "not_worse_by_1_point": mean_gap >= -1.0,
        "runs": runs,
    }
