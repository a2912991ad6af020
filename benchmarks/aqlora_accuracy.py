"""Held-out accuracy of a short SmolLM2-135M fine-tune on BIG-bench strategyqa: QLoRA vs AQLoRA vs fp32 LoRA, and
which AQLoRA ranking repairs the most quantization damage.

Every arm trains LoRA (r=16, all linears unless the setting restricts them) for the same number of steps on the same
batches (prompt "Question: ...\\nAnswer (yes or no):" + " yes"/" no", loss on the answer token only), then answers
the held-out split by comparing the log-likelihood of " yes" and " no". Arms: `base` (fp32, no training),
`lora_fp32`, `qlora_nf4` (bitsandbytes), `pact` (all-NVFP4), `aqlora_quality` (protection ranked by NVFP4
reconstruction error), `aqlora_speed`, `aqlora_sensitivity` (the quality setting ranked by gradient sensitivity, on
the first training batch as PactTrainer does), and the controls `aqlora_random` / `aqlora_sensitivity_random`: a
random protection list matched in count and memory to the error-ranked / sensitivity-ranked one. Before training,
each arm's held-out LM loss over all tokens of every question measures its stored base alone (quantization damage,
and how much protection repairs it), which the few answer tokens cannot resolve.

Each seed (`--seeds`) draws its own split, training order, calibration batch and random controls. Comparisons are
paired: per seed over the same held-out questions (mean difference +/- standard error), then over seeds (mean of the
per-seed differences +/- their standard error, and in how many seeds the arm won).

    python benchmarks/aqlora_accuracy.py                 # 3 seeds x 9 arms x 300 steps: hours on 2 cores
    python benchmarks/aqlora_accuracy.py --steps 0 --arms base pact aqlora_quality aqlora_random \\
        aqlora_sensitivity aqlora_sensitivity_random     # the stored-base comparison alone: minutes
    python benchmarks/aqlora_accuracy.py --quick         # a few steps, a few held-out questions

Writes results.json (after every seed: `--resume` keeps the seeds and arms an interrupted run of the same settings
finished) and a bar chart (PNG with matplotlib, else SVG) to --output; stdout gets ONE JSON line.
Evaluation runs under no_grad in train mode (no dropout anywhere): bitsandbytes repacks Linear4bit weights in place
in eval() + no_grad on CPU (FACTS.md), so every arm is evaluated the same way.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import resume  # noqa: E402
import strategyqa  # noqa: E402  (the data preparation beside this script)

from optimum_pact.nvfp4 import SCALE_RULES  # noqa: E402
from optimum_pact.precision.compute_dtype import DTYPES  # noqa: E402

ARMS = ("base", "lora_fp32", "qlora_nf4", "pact", "aqlora_quality", "aqlora_speed", "aqlora_random",
        "aqlora_sensitivity", "aqlora_sensitivity_random")  # fmt: skip
AQLORA_ARMS = ARMS[4:]
COMPARISONS = (  # (arm, reference): arm - reference, paired
    ("aqlora_quality", "aqlora_random"),  # does ranking by error beat random at the same premium?
    ("aqlora_sensitivity", "aqlora_sensitivity_random"),  # ... ranking by sensitivity?
    ("aqlora_sensitivity", "aqlora_quality"),
    ("aqlora_sensitivity", "aqlora_random"),  # ... a random list of the error ranking's shapes, at its premium
    ("aqlora_quality", "pact"),
    ("aqlora_sensitivity", "pact"),
    ("pact", "qlora_nf4"),
    ("aqlora_quality", "qlora_nf4"),
    ("pact", "lora_fp32"),
)


def log(*args) -> None:
    print(*args, file=sys.stderr, flush=True)


def build(arm: str, path: str, args, calibration: dict, rankings: dict):
    """The model of one arm with its adapters, plus a description of what was protected / adapted.

    `calibration` is the first training batch (what PactTrainer ranks by sensitivity on); `rankings` caches the
    sensitivity-ranked list of this seed for the random control matched to it.
    """
    import torch
    from peft import LoraConfig, get_peft_model
    from protection_controls import matched_random_protected, protection_premium_mib
    from transformers import AutoModelForCausalLM

    from optimum_pact.precision import resolve_dtype
    from peft_ext import PactConfig
    from peft_ext.backward_stop import stop_backward_below
    from peft_ext.blocks import lowest_trainable_block
    from peft_ext.ranking import choose_protected

    lora = dict(r=args.r, lora_alpha=2 * args.r, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
    dtype = torch.float32 if arm in ("base", "lora_fp32") else resolve_dtype(args.dtype)
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
    config = PactConfig(
        **lora, protect_fraction=args.protect_fraction, rank_by=args.rank_by,
        adapt="speed" if arm == "aqlora_speed" else "quality",
        **({"adapt_top_blocks": args.adapt_top_blocks} if arm == "aqlora_speed" and args.adapt_top_blocks else {}),
    )  # fmt: skip
    if arm.startswith("aqlora_sensitivity"):
        if "sensitivity" not in rankings:
            start = time.perf_counter()
            sensitive = dataclasses.replace(config, rank_by="sensitivity").with_calibration(model, calibration)
            rankings["sensitivity"] = sensitive.protected_modules
            rankings["probe_s"] = time.perf_counter() - start
            log(f"    sensitivity ranking on the first training batch: {rankings['probe_s']:.0f} s")
        ranked, info["probe_s"] = rankings["sensitivity"], rankings["probe_s"]
        config = dataclasses.replace(config, rank_by="sensitivity", protected_modules=ranked)
    if arm.endswith("_random"):
        ranked = config.protected_modules or choose_protected(model, args.protect_fraction, args.rank_by)
        info["ranking_would_protect"] = ranked
        config = dataclasses.replace(config, protected_modules=matched_random_protected(model, ranked, seed=args.seed))
    model = get_peft_model(model, config)
    if arm == "aqlora_speed":
        stop_backward_below(model, lowest_trainable_block(model))
    protected = model.peft_config["default"].protected_modules
    info.update(protected=protected, premium_mib=protection_premium_mib(model, protected),
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


def lm_losses(model, tokenizer, test_set, batch: int = 16) -> tuple[list[float], list[int]]:
    """Per held-out question: the summed next-token loss over every token of its prompt + answer, and the count.

    Measured before training (adapters start at zero, so this is the base model as each arm stores it): a robust
    measure of the damage quantization does and of how much protection repairs; the answer token alone is too
    few tokens to tell arms apart.
    """
    import torch

    model.train()  # as in evaluate()
    sums, counts = [], []
    with torch.no_grad():
        for i in range(0, len(test_set), batch):
            ids, mask, _, _, _ = encode(tokenizer, test_set[i : i + batch], with_answer=True)
            logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
            loss = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
            keep = mask[:, 1:].bool()
            sums += loss.masked_fill(~keep, 0).sum(dim=1).tolist()
            counts += keep.sum(dim=1).tolist()
    return sums, counts


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


def mean_se(values: list[float]) -> dict:
    """Mean and standard error of the mean (None for a single value)."""
    mean = statistics.fmean(values)
    se = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else None
    return {"mean": mean, "se": se, "n": len(values)}


def compare(results: dict, arm: str, ref: str) -> dict | None:
    """`arm - ref` per seed (paired over the same questions) and over seeds: LM loss per token and accuracy.

    The per-question LM loss difference is each question's mean loss per token; lower is better.
    """
    seeds = [seed for seed, arms in results.items() if arm in arms and ref in arms]
    if not seeds:
        return None
    out = {"per_seed": {}}
    for seed in seeds:
        a, b = results[seed][arm], results[seed][ref]
        loss = [(x - y) / n for x, y, n in zip(a["loss_sums"], b["loss_sums"], a["token_counts"])]
        out["per_seed"][seed] = {
            "lm_loss": mean_se(loss),
            "lm_loss_per_token": a["lm_loss_before_training"] - b["lm_loss_before_training"],
        }
        if a["correct"]:
            out["per_seed"][seed]["accuracy"] = mean_se([int(x) - int(y) for x, y in zip(a["correct"], b["correct"])])
    for key in ("lm_loss", "accuracy") if "accuracy" in out["per_seed"][seeds[0]] else ("lm_loss",):
        diffs = [entry[key]["mean"] for entry in out["per_seed"].values()]
        better = [d < 0 if key == "lm_loss" else d > 0 for d in diffs]
        out[key] = {**mean_se(diffs), "seeds_better": sum(better)}
    return out


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


def run_seed(seed: int, arms: list[str], path: str, tokenizer, examples, args, done: dict) -> dict:
    """Every arm on one seed's split, training order, calibration batch and controls; arms in `done` (this seed's
    results from an interrupted run of the same configuration) are kept, not rerun."""
    import random

    import torch

    args.seed = seed
    train_set, test_set = strategyqa.split(examples, args.test_size, seed)
    random.Random(seed).shuffle(train_set)
    calibration = dict(zip(("input_ids", "attention_mask", "labels"),
                           encode(tokenizer, train_set[: args.batch], with_answer=True)[:3]))  # fmt: skip
    results, rankings = {}, {}
    if "aqlora_sensitivity" in done:  # its random control draws from the same ranking: no second probe
        sensitive = done["aqlora_sensitivity"]
        rankings = {"sensitivity": sensitive["protected"], "probe_s": sensitive["probe_s"]}
    for arm in arms:
        if arm in done:
            log(f"seed {seed} {arm}: kept from {args.output_dir / 'results.json'}")
            results[arm] = done[arm]
            continue
        log(f"seed {seed} {arm}: building")
        torch.manual_seed(seed)
        model, info = build(arm, path, args, calibration, rankings)
        if "protected" in info:
            kept_16 = len(info["protected"])
            log(f"seed {seed} {arm}: {kept_16} linears kept 16-bit, premium {info['premium_mib']:.2f} MiB")
        sums, counts = lm_losses(model, tokenizer, test_set)
        base_loss = sum(sums) / sum(counts)
        log(f"seed {seed} {arm}: held-out LM loss of the stored base {base_loss:.4f}")
        start = time.perf_counter()
        losses = train(model, tokenizer, train_set, args) if arm != "base" and args.steps else []
        train_s = time.perf_counter() - start
        correct = evaluate(model, tokenizer, test_set) if args.steps else []  # --steps 0: the stored bases alone
        acc = sum(correct) / len(correct) if correct else None
        results[arm] = {"accuracy": acc, "se": math.sqrt(acc * (1 - acc) / len(correct)) if correct else None,
                        "n": len(correct),
                        "lm_loss_before_training": base_loss, "train_s": train_s, "first_losses": losses[:5],
                        "last_losses": losses[-5:], "correct": correct, "loss_sums": sums, "token_counts": counts,
                        "majority_class": max(sum(e.answer for e in test_set), sum(not e.answer for e in test_set))
                        / len(test_set), **info}  # fmt: skip
        if correct:
            log(f"seed {seed} {arm}: held-out accuracy {acc:.1%} +/- {results[arm]['se']:.1%} (train {train_s:.0f} s)")
        del model
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="model folder (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    parser.add_argument("--steps", type=int, default=300, help="training steps per arm (0: the stored bases only)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--r", type=int, default=16)
    parser.add_argument("--test-size", type=int, default=500)
    parser.add_argument(
        "--seeds",
        type=int,
        nargs="+",
        default=[0, 1, 2],
        help="each seeds the split, the training order, the calibration batch and the controls",
    )
    parser.add_argument(
        "--dtype",
        choices=DTYPES,
        default="auto",
        help="compute dtype of the quantized arms (auto: bf16 where the CPU has it natively, else fp32)",
    )
    parser.add_argument("--protect-fraction", type=float, default=0.2)
    parser.add_argument(
        "--rank-by",
        choices=("nf4", "nvfp4"),
        default="nvfp4",
        help="the error ranking of aqlora_quality, aqlora_speed and aqlora_random",
    )
    parser.add_argument("--adapt-top-blocks", type=int, default=None)
    parser.add_argument("--output", help="results folder (default: <cache>/aqlora/accuracy)")
    parser.add_argument("--quick", action="store_true", help="3 steps of 2, 16 held-out questions: machinery only")
    parser.add_argument(
        "--resume",
        action="store_true",
        help="keep the seeds and arms that --output's results.json already holds for these settings",
    )
    args = parser.parse_args()  # fmt: skip
    if args.quick:
        args.steps, args.batch, args.test_size = 3, 2, 16
    from transformers import AutoTokenizer

    from optimum_pact.cache import cache_dir
    from optimum_pact.commands.default_model import ensure_default_model

    path = args.model or str(ensure_default_model())
    out = Path(args.output) if args.output else cache_dir("aqlora", "accuracy-quick" if args.quick else "accuracy")
    out.mkdir(parents=True, exist_ok=True)
    examples = strategyqa.load_examples(strategyqa.ensure_task())
    tokenizer = AutoTokenizer.from_pretrained(path)
    config = {k: getattr(args, k) for k in ("steps", "batch", "lr", "r", "test_size", "dtype", "protect_fraction",
                                            "rank_by", "adapt_top_blocks", "quick")}  # fmt: skip
    config["dtype"] = resume.ran_dtype(args.dtype)  # what ran, so that --resume does not mix fp32 and bf16 seeds
    config["nvfp4_scale_rule"] = SCALE_RULES[0]  # every arm but fp32 / nf4 stands on it: nor mix rules
    args.output_dir = out
    saved = out / "results.json"
    previous = json.loads(saved.read_text()) if args.resume and saved.exists() else {}
    if previous:
        resume.check_settings(saved, previous, config)
    kept = {int(seed): arms for seed, arms in previous.get("raw", {}).items()}
    dropped = {(s, arm) for s, arms in kept.items() for arm in arms if s not in args.seeds or arm not in args.arms}
    if dropped:  # saving would lose them
        raise SystemExit(f"--resume: {saved} holds (seed, arm) runs this command leaves out: {sorted(dropped)}; pass "
                         "those --seeds and --arms too, or another --output.")  # fmt: skip
    results = {}
    for seed in args.seeds:
        results[seed] = run_seed(seed, args.arms, path, tokenizer, examples, args, kept.get(seed, {}))
        summarize(results, {**config, "seeds": list(results)}, out, chart=False)  # a crash keeps the seeds done
    summary = summarize(results, {**config, "seeds": args.seeds}, out, chart=bool(args.steps))
    print(json.dumps(summary))


def summarize(results: dict, config: dict, out: Path, chart: bool) -> dict:
    """Paired comparisons and per-arm means of `results`; writes results.json (atomically) and, with `chart`, the
    bar chart. Returns the summary (results.json less the per-question data)."""
    from common import cpu_model

    comparisons = {f"{a}_vs_{b}": c for a, b in COMPARISONS if (c := compare(results, a, b)) is not None}
    for name, c in comparisons.items():
        loss, acc = c["lm_loss"], c.get("accuracy")
        se = lambda x: "" if x["se"] is None else f" +/- {x['se']:.4f}"  # noqa: E731
        accuracy = "" if acc is None else (f"; accuracy {acc['mean']:+.1%}{se(acc)} (higher in {acc['seeds_better']} "
                                           f"of {acc['n']})")  # fmt: skip
        log(f"{name}: LM loss {loss['mean']:+.4f}{se(loss)} (lower in {loss['seeds_better']} of {loss['n']} seeds)"
            f"{accuracy}")  # fmt: skip
    arms = list(next(iter(results.values())))
    pooled = {arm: [c for seed in results for c in results[seed][arm]["correct"]] for arm in arms}
    summary_arms = {}
    for arm, c in pooled.items():
        acc = sum(c) / len(c) if c else None
        loss = statistics.fmean(results[seed][arm]["lm_loss_before_training"] for seed in results)
        summary_arms[arm] = {"lm_loss_before_training": loss}
        if "premium_mib" in results[next(iter(results))][arm]:
            summary_arms[arm]["premium_mib"] = statistics.fmean(results[s][arm]["premium_mib"] for s in results)
        if c:
            summary_arms[arm].update(accuracy=acc, se=math.sqrt(acc * (1 - acc) / len(c)))
    majority = statistics.fmean(next(iter(r.values()))["majority_class"] for r in results.values())
    plotted = plot(summary_arms, majority, out / "accuracy.png") if chart else None
    per_seed = {seed: {arm: {k: v for k, v in r.items() if k not in ("correct", "loss_sums", "token_counts")}
                       for arm, r in runs.items()} for seed, runs in results.items()}  # fmt: skip
    summary = {"bench": "aqlora_accuracy", **config, "cpu": cpu_model(), "majority_class": majority,
               "chart": str(plotted), "arms": summary_arms, "comparisons": comparisons}  # fmt: skip
    partial = out / "results.json.partial"
    partial.write_text(json.dumps({**summary, "per_seed": per_seed, "raw": results}))
    partial.replace(out / "results.json")
    return summary


if __name__ == "__main__":
    main()
