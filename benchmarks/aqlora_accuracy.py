"""Held-out accuracy of a short SmolLM2-135M fine-tune on BIG-bench strategyqa: QLoRA vs AQLoRA vs fp32 LoRA.

Every arm trains LoRA (r=16, all linears unless the setting restricts them) for the same number of steps on the same
batches (prompt "Question: ...\\nAnswer (yes or no):" + " yes"/" no", loss on the answer token only), then answers
the fixed held-out split by comparing the log-likelihood of " yes" and " no". Arms: `base` (no training),
`lora_fp32`, `qlora_nf4` (bitsandbytes, bf16 compute), `pact` (all-NVFP4), `aqlora_quality`, `aqlora_speed`, and
`aqlora_random`: the quality setting with a memory-matched random protection list instead of the error-ranked one
(the control). Accuracy comes with its binomial standard error and, against QLoRA, the paired difference with its
standard error. Before training, each arm's held-out LM loss over all tokens measures its stored base alone
(quantization damage, and how much protection repairs it), which the few answer tokens cannot resolve.

    python benchmarks/aqlora_accuracy.py                 # ~300 steps x 6 arms; tens of minutes on 2 cores
    python benchmarks/aqlora_accuracy.py --quick         # a few steps, a few held-out questions

Writes results.json and a bar chart (PNG with matplotlib, else SVG) to --output; stdout gets ONE JSON line.
Evaluation runs under no_grad in train mode (no dropout anywhere): bitsandbytes repacks Linear4bit weights in place
in eval() + no_grad on CPU (FACTS.md), so every arm is evaluated the same way.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import strategyqa  # noqa: E402  (the data preparation beside this script)

ARMS = ("base", "lora_fp32", "qlora_nf4", "pact", "aqlora_quality", "aqlora_speed", "aqlora_random")
AQLORA_ARMS = ("aqlora_quality", "aqlora_speed", "aqlora_random")


def log(*args) -> None:
    print(*args, file=sys.stderr, flush=True)


def pact_fields() -> set[str]:
    from peft_ext import PactConfig

    return set(PactConfig.__dataclass_fields__)


def build(arm: str, path: str, args):
    """The model of one arm with its adapters, plus a description of what was protected / adapted."""
    import torch
    from peft import LoraConfig, get_peft_model
    from protection_controls import matched_random_protected
    from transformers import AutoModelForCausalLM

    from peft_ext import PactConfig
    from peft_ext.backward_stop import stop_backward_below
    from peft_ext.blocks import lowest_trainable_block
    from peft_ext.ranking import choose_protected

    lora = dict(r=args.r, lora_alpha=2 * args.r, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
    dtype = torch.float32 if arm in ("base", "lora_fp32") else torch.bfloat16
    if arm == "qlora_nf4":
        from transformers import BitsAndBytesConfig

        quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, quantization_config=quant)
        return get_peft_model(model, LoraConfig(**lora)), {}
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    if arm == "base":
        return model, {}
    if arm == "lora_fp32":
        return get_peft_model(model, LoraConfig(**lora)), {}
    if arm == "pact":
        return get_peft_model(model, PactConfig(**lora)), {}
    info = {}
    extra = {"protect_fraction": args.protect_fraction, "adapt": "speed" if arm == "aqlora_speed" else "quality"}
    if arm == "aqlora_speed" and args.adapt_top_blocks is not None:
        extra["adapt_top_blocks"] = args.adapt_top_blocks
    if arm == "aqlora_random":
        ranked = choose_protected(model, args.protect_fraction, args.rank_by)
        extra["protected_modules"] = matched_random_protected(model, ranked, seed=args.seed)
        info["error_ranked_would_protect"] = ranked
    model = get_peft_model(model, PactConfig(**lora, **extra))
    if arm == "aqlora_speed":
        stop_backward_below(model, lowest_trainable_block(model))
    config = model.peft_config["default"]
    info.update(protected=getattr(config, "protected_modules", None),
                lowest_adapted_block=lowest_trainable_block(model))  # fmt: skip
    return model, info


def encode(tokenizer, examples, with_answer: bool):
    """Right-padded ids, attention mask, the answer position and (for training) labels on the answer token only."""
    import torch

    rows = [tokenizer(strategyqa.prompt(e.question)).input_ids for e in examples]
    answer_ids = [tokenizer(a).input_ids[0] for a in strategyqa.ANSWERS]
    if with_answer:
        rows = [r + [answer_ids[0] if e.answer else answer_ids[1]] for r, e in zip(rows, examples)]
    width = max(map(len, rows))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    labels = torch.full_like(ids, -100)
    last = torch.tensor([len(r) - 1 for r in rows])
    if with_answer:
        labels[torch.arange(len(rows)), last] = ids[torch.arange(len(rows)), last]
    return ids, mask, labels, last, answer_ids


def train(model, tokenizer, train_set, args) -> list[float]:
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr)
    model.train()
    losses = []
    for step in range(args.steps):
        start = step * args.batch % len(train_set)
        batch = (train_set + train_set)[start : start + args.batch]  # the same batches, in order, for every arm
        ids, mask, labels, _, _ = encode(tokenizer, batch, with_answer=True)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if step % max(1, args.steps // 10) == 0:
            log(f"    step {step + 1}/{args.steps}: loss {loss.item():.3f}")
    return losses


def lm_loss(model, tokenizer, test_set, batch: int = 16) -> float:
    """Mean next-token loss over every token of the held-out prompts + answers.

    Measured before training (adapters start at zero, so this is the base model as each arm stores it): a robust
    measure of the damage quantization does and of how much protection repairs; the answer token alone is too
    few tokens to tell arms apart.
    """
    import torch

    model.train()  # as in evaluate()
    total = count = 0
    with torch.no_grad():
        for i in range(0, len(test_set), batch):
            ids, mask, _, _, _ = encode(tokenizer, test_set[i : i + batch], with_answer=True)
            n = int(mask[:, 1:].sum())
            total += model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss.item() * n
            count += n
    return total / count


def evaluate(model, tokenizer, test_set, batch: int = 16) -> list[bool]:
    """Per held-out question: does log p(" yes") > log p(" no") agree with the answer?"""
    import torch

    model.train()  # see the module docstring: no dropout here, and no bitsandbytes repack
    correct = []
    with torch.no_grad():
        for i in range(0, len(test_set), batch):
            chunk = test_set[i : i + batch]
            ids, mask, _, last, (yes, no) = encode(tokenizer, chunk, with_answer=False)
            logits = model(input_ids=ids, attention_mask=mask).logits[torch.arange(len(chunk)), last].float()
            says_yes = logits[:, yes] > logits[:, no]  # same softmax normaliser: comparing logits is enough
            correct += [bool(s) == e.answer for s, e in zip(says_yes.tolist(), chunk)]
    return correct


def paired(a: list[bool], b: list[bool]) -> dict:
    """Accuracy difference a - b over the same questions, with its paired standard error."""
    d = [int(x) - int(y) for x, y in zip(a, b)]
    mean = sum(d) / len(d)
    var = sum((x - mean) ** 2 for x in d) / max(1, len(d) - 1)
    return {"diff": mean, "se": math.sqrt(var / len(d))}


def plot(results: dict, majority: float, out: Path) -> Path:
    """Bar chart of held-out accuracy with +/- 1 SE; PNG through matplotlib, else a dependency-free SVG."""
    arms = [a for a in results if "accuracy" in results[a]]
    acc = [results[a]["accuracy"] for a in arms]
    se = [results[a]["se"] for a in arms]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib is not installed: writing an SVG chart instead of a PNG")
        return _svg(arms, acc, se, majority, out.with_suffix(".svg"))
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.bar(arms, acc, yerr=se, capsize=4, color="#4878a8")
    ax.axhline(majority, color="grey", linestyle="--", label=f"majority class {majority:.1%}")
    ax.set_ylabel("held-out accuracy")
    ax.set_title("SmolLM2-135M on BIG-bench strategyqa, same step budget")
    ax.set_ylim(0, 1)
    ax.legend()
    fig.autofmt_xdate()
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    return out


def _svg(arms, acc, se, majority, out: Path) -> Path:
    width, bottom, bar = 120 * len(arms) + 80, 260, 70
    y = lambda v: bottom - v * 220  # noqa: E731
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="320" font-family="sans-serif">',
        '<text x="60" y="20">SmolLM2-135M, BIG-bench strategyqa: held-out accuracy (+/- 1 SE)</text>',
        f'<line x1="60" x2="{width - 10}" y1="{y(majority)}" y2="{y(majority)}" stroke="grey" stroke-dasharray="4"/>',
        f'<text x="{width - 150}" y="{y(majority) - 4}" fill="grey">majority {majority:.1%}</text>',
    ]
    for i, (arm, a, s) in enumerate(zip(arms, acc, se)):
        x, mid = 80 + i * 120, 80 + i * 120 + bar / 2
        parts += [
            f'<rect x="{x}" y="{y(a)}" width="{bar}" height="{bottom - y(a)}" fill="#4878a8"/>',
            f'<line x1="{mid}" x2="{mid}" y1="{y(a + s)}" y2="{y(a - s)}" stroke="black"/>',
            f'<text x="{x}" y="{y(a) - 6}">{a:.1%}</text>',
            f'<text x="{x}" y="{bottom + 16}">{arm}</text>',
        ]
    out.write_text("\n".join([*parts, "</svg>"]) + "\n")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="model folder (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--r", type=int, default=16)
    parser.add_argument("--test-size", type=int, default=500)
    parser.add_argument("--seed", type=int, default=0, help="seeds the split, the training order and the control")
    parser.add_argument("--protect-fraction", type=float, default=0.2)
    parser.add_argument("--rank-by", choices=("nf4", "nvfp4"), default="nvfp4", help="for the random control")
    parser.add_argument("--adapt-top-blocks", type=int, default=None)
    parser.add_argument("--output", help="results folder (default: <cache>/aqlora/accuracy)")
    parser.add_argument("--quick", action="store_true", help="3 steps of 2, 16 held-out questions: machinery only")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.batch, args.test_size = 3, 2, 16
    import random

    import torch
    from transformers import AutoTokenizer

    from optimum_pact.cache import cache_dir
    from optimum_pact.commands.default_model import ensure_default_model

    path = args.model or str(ensure_default_model())
    out = Path(args.output) if args.output else cache_dir("aqlora", "accuracy-quick" if args.quick else "accuracy")
    out.mkdir(parents=True, exist_ok=True)
    train_set, test_set = strategyqa.split(
        strategyqa.load_examples(strategyqa.ensure_task()), args.test_size, args.seed
    )
    random.Random(args.seed).shuffle(train_set)
    majority = max(sum(e.answer for e in test_set), sum(not e.answer for e in test_set)) / len(test_set)
    tokenizer = AutoTokenizer.from_pretrained(path)
    fields, arms, skipped = pact_fields(), [], []
    for arm in args.arms:
        needs = {"protect_fraction"} | ({"protected_modules"} if arm == "aqlora_random" else set())
        (skipped if arm in AQLORA_ARMS and not needs <= fields else arms).append(arm)
    if skipped:
        log(f"PactConfig lacks the AQLoRA fields (issue 5 wiring pending): skipping {', '.join(skipped)}")

    results = {}
    for arm in arms:
        log(f"{arm}: building")
        torch.manual_seed(args.seed)
        model, info = build(arm, path, args)
        base_loss = lm_loss(model, tokenizer, test_set)
        log(f"{arm}: held-out LM loss of the stored base {base_loss:.4f}")
        start = time.perf_counter()
        losses = train(model, tokenizer, train_set, args) if arm != "base" else []
        train_s = time.perf_counter() - start
        correct = evaluate(model, tokenizer, test_set)
        acc = sum(correct) / len(correct)
        results[arm] = {"accuracy": acc, "se": math.sqrt(acc * (1 - acc) / len(correct)), "n": len(correct),
                        "lm_loss_before_training": base_loss,
                        "train_s": train_s, "first_losses": losses[:5], "last_losses": losses[-5:],
                        "correct": correct, **info}  # fmt: skip
        log(f"{arm}: held-out accuracy {acc:.1%} +/- {results[arm]['se']:.1%} (train {train_s:.0f} s)")
        del model
    if "qlora_nf4" in results:
        for arm in results:
            if arm != "qlora_nf4":
                results[arm]["vs_qlora"] = paired(results[arm]["correct"], results["qlora_nf4"]["correct"])
    chart = plot(results, majority, out / "accuracy.png")
    config = {k: getattr(args, k) for k in ("steps", "batch", "lr", "r", "test_size", "seed", "protect_fraction",
                                            "rank_by", "adapt_top_blocks", "quick")}  # fmt: skip
    summary = {"bench": "aqlora_accuracy", **config, "majority_class": majority, "skipped_arms": skipped,
               "chart": str(chart), "results": {a: {k: v for k, v in r.items() if k != "correct"}
                                                for a, r in results.items()}}  # fmt: skip
    (out / "results.json").write_text(
        json.dumps({**summary, "per_question": {a: r["correct"] for a, r in results.items()}})
    )
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
