"""The AQLoRA sections of docs/benchmarks.md (benchmarks/write_docs.py): aqlora_accuracy.py prints a JSON line and
no table, so its table is written here."""

from __future__ import annotations

AQLORA_ARMS = {
    "base": "fp32 base, no training",
    "lora_fp32": "peft LoRA fp32",
    "qlora_nf4": "QLoRA (bnb nf4)",
    "pact": "all-NVFP4, no protection",
    "aqlora_quality": "protection ranked by {rank_by} error",
    "aqlora_speed": "AQLoRA speed (ranked by {rank_by} error)",
    "aqlora_random": "random list matched to the {rank_by}-error ranking",
    "aqlora_sensitivity": "protection ranked by gradient sensitivity",
    "aqlora_sensitivity_random": "random list matched to the sensitivity ranking",
}
RANKINGS = {"nvfp4": "NVFP4", "nf4": "nf4"}  # --rank-by: whose 4-bit reconstruction error


def _pm(value: dict, scale: float, digits: int) -> str:
    se = "" if value.get("se") is None else f" +/- {value['se'] * scale:.{digits}f}"
    return f"{value['mean'] * scale:+.{digits}f}{se}"


def aqlora_table(results: dict) -> str:
    """aqlora_accuracy.py's results (it prints a JSON line, no table): one row per arm, then its paired
    comparisons as it computed them."""
    trained = bool(results["steps"])
    training = f"{results['steps']} steps of {results['batch']}, lr {results['lr']}" if trained else "no training"
    rank_by = RANKINGS.get(results["rank_by"], results["rank_by"])
    lines = [
        f"SmolLM2-135M-Instruct on BIG-bench strategyqa, LoRA r={results['r']}, {training}, "
        f"{results['test_size']} held-out questions per seed, seeds {results['seeds']}, compute dtype "
        f"{results['dtype']}, protect_fraction {results['protect_fraction']}, NVFP4 scale rule "
        f"{results['nvfp4_scale_rule']}. Stored-base LM loss: the held-out loss over every token before any "
        "training (mean of the seeds); premium: the 16-bit layers' memory above all-NVFP4.",
        "",
        "| arm | " + ("held-out accuracy (pooled, +/- SE) | " if trained else "") + "stored-base LM loss | premium |",
        "|---|" + ("---|" if trained else "") + "---|---|",
    ]  # fmt: skip
    for arm, r in results["arms"].items():
        cells = [f"{AQLORA_ARMS.get(arm, arm).format(rank_by=rank_by)} (`{arm}`)"]
        if trained:
            cells.append("-" if r.get("accuracy") is None else f"{r['accuracy']:.1%} +/- {r['se']:.1%}")
        premium = r.get("premium_mib")
        cells += [f"{r['lm_loss_before_training']:.3f}", "0 MiB" if premium is None else f"{premium:.1f} MiB"]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Paired differences, arm minus reference (per seed over the same questions, then mean +/- SE over "
                  "the seeds):", ""]  # fmt: skip
    for name, c in results["comparisons"].items():
        arm, ref = name.split("_vs_")
        loss = c["lm_loss"]
        text = f"- `{arm}` - `{ref}`: stored-base LM loss {_pm(loss, 1, 3)} (lower in {loss['seeds_better']} of "
        text += f"{loss['n']} seeds)"
        if "accuracy" in c:
            acc = c["accuracy"]
            text += f"; accuracy {_pm(acc, 100, 1)} points (higher in {acc['seeds_better']} of {acc['n']} seeds)"
        lines.append(text)
    per_seed = results.get("per_seed", {})
    probes = [f"{arms['aqlora_sensitivity']['probe_s']:.0f} s (seed {seed})" for seed, arms in per_seed.items()
              if "probe_s" in arms.get("aqlora_sensitivity", {})]  # fmt: skip
    if probes:
        lines += ["", "Sensitivity probe (one forward+backward per targeted linear on the first training batch): "
                      + ", ".join(probes) + "."]  # fmt: skip
    if trained:
        train_s = [run["train_s"] for arms in per_seed.values() for run in arms.values()]
        lines += ["", f"Training: {min(train_s):.0f}-{max(train_s):.0f} s per arm and seed."]
    return "\n".join(lines)
