"""Summary, targets, README table and plots of eval_personalization.py's results (a dict, as in results.json)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

TARGETS = {  # (method, baseline, the least acceptable difference in accuracy points)
    "pact_vs_fp32": ("pact", "fp32", -1.0),
    "pact_vs_mezo_equal_wallclock": ("pact", "mezo", 0.0),
    "pact_vs_qlora": ("pact", "qlora", 0.0),
    "pact_exact_vs_fp32": ("pact_exact", "fp32", -1.0),
}
LABELS = {
    "zero_shot": "zero-shot base model", "majority": "majority tag (no model)", "shared": "shared adapter (PACT)",
    "cpu_bf16": "peft LoRA bf16 (optimized CPU)", "fp32": "peft LoRA fp32 (reference)", "qlora": "QLoRA (bnb nf4)",
    "pact": "PACT (torch backend)", "pact_exact": "PACT + memory savers (exact)",
    "mezo": "MeZO forward-only, PACT's wall-clock",
}  # fmt: skip


def _mean(values):
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def summarize(results: dict) -> None:
    """Adds results["summary"] (per workload and method: means over users of each user's mean over seeds) and
    results["targets"]: paired differences, per user (its mean over the seeds both methods ran), then mean +/-
    standard error over users."""
    summary, targets, memory = {}, {}, results.get("memory", {})
    for name, workload in results["workloads"].items():
        users = workload["users"].values()
        methods = list(next(iter(users))["methods"]) if users else []
        rows = {}
        for method in methods:
            runs = [u["methods"][method] for u in users]
            train_s = _mean(r.get("train_s") for r in runs)
            if method == "shared" and train_s is not None:
                train_s /= len(runs)  # one adapter trained once on all users' data: its time per user
            rows[method] = {
                "accuracy": _mean(r["accuracy"] for r in runs),
                "macro_f1": _mean(r["f1"] for r in runs),
                "pooled_accuracy": _mean(p == g for u in users for run in u["methods"][method]["seeds"].values()
                                         for p, g in zip(run["predictions"], u["golds"])),
                "train_s": train_s,
                "steps": _mean(r.get("steps") for r in runs),
                "peak_gib": memory.get(method, {}).get("peak_gib"),  # not measured for "shared": shown as "-"
                "users": sum(r["accuracy"] is not None for r in runs),
                "seeds": max(len(r["seeds"]) for r in runs),
            }  # fmt: skip
        summary[name] = rows
        for target, (method, baseline, least) in TARGETS.items():
            if method not in rows or baseline not in rows:
                continue
            diffs, pairs = [], 0
            for user in users:  # per user, over the seeds both methods ran (a resumed run may add seeds to some)
                mine, theirs = user["methods"][method]["seeds"], user["methods"][baseline]["seeds"]
                both = [seed for seed in mine if seed in theirs]
                if both:  # none: an interrupted run that has not reached both methods on this user yet
                    diffs.append(100 * sum(mine[s]["accuracy"] - theirs[s]["accuracy"] for s in both) / len(both))
                    pairs += len(both)
            if not diffs:
                continue
            mean = sum(diffs) / len(diffs)
            sd = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (len(diffs) - 1)) if len(diffs) > 1 else None
            se = sd / math.sqrt(len(diffs)) if sd is not None else None
            targets.setdefault(name, {})[target] = {
                "points": mean, "se": se, "least": least, "met": mean >= least, "users": len(diffs), "pairs": pairs
            }  # fmt: skip
    results["summary"], results["targets"] = summary, targets


def _fmt(value, pattern: str) -> str:
    return "-" if value is None else pattern.format(value)


def measured(results: dict) -> str:
    """When and where: each machine of a run resumed over sittings, with the dates of its sittings."""
    pieces = results.get("pieces") or [results]
    machines = {}
    for piece in pieces:
        machines.setdefault(piece["machine"], []).append(piece["date"])
    return " and ".join(f"{', '.join(sorted(set(dates)))} on {machine}" for machine, dates in machines.items())


NVFP4_METHODS = ("shared", "pact", "pact_exact")  # the methods on the NVFP4 base, whose runs record its scale rule


def run_rule(run: dict) -> str:
    """The NVFP4 scale rule a run (or memory probe, or qnn check) on the NVFP4 base used: "6" where none is recorded,
    the only rule before rules were recorded."""
    return run.get("nvfp4_scale_rule", "6")


def scale_rules(results: dict) -> str:
    """The NVFP4 scale rules the runs on the NVFP4 base used, e.g. "4/6", or "4/6 (6: 12 runs)" part way through a
    --resume that redoes them; "6" where none was recorded (the only rule before rules were recorded); "" without
    such runs."""
    counts = {}
    for workload in results.get("workloads", {}).values():
        for user in workload["users"].values():
            for method in NVFP4_METHODS:
                for run in user["methods"].get(method, {}).get("seeds", {}).values():
                    counts[run_rule(run)] = counts.get(run_rule(run), 0) + 1
    if not counts:
        return ""
    ranked = sorted(counts, key=counts.get, reverse=True)
    others = "; ".join(f"{rule}: {counts[rule]} runs" for rule in ranked[1:])
    return ranked[0] + (f" ({others})" if others else "")


def seeds_run(results: dict) -> list[int]:
    """The seeds some run was made with (config["seeds"] is what the sittings asked for: a resumed run stopped early
    and restarted with fewer seeds asked for more than it ran)."""
    return sorted({int(seed) for workload in results.get("workloads", {}).values()
                   for user in workload["users"].values() for entry in user["methods"].values()
                   for seed in entry.get("seeds", {})})  # fmt: skip


def compute_dtype(config: dict) -> str:
    dtype = config.get("dtype", "bf16")
    resolved = config.get("compute_dtype")
    return f"{resolved} ({dtype})" if resolved and resolved != dtype else dtype


def seed_counts(rows: dict) -> str:
    """How many seeds each user's means are over: "its 3 seeds", or where a resumed run added seeds to some methods
    "its seeds: 6 for fp32, qlora, pact; 3 for the others"."""
    counts = {}
    for method, row in rows.items():
        counts.setdefault(row.get("seeds"), []).append(method)
    if len(counts) == 1:
        return "seeds" if None in counts else f"its {next(iter(counts))} seeds"
    ranked = sorted(counts, key=lambda n: -(n or 0))
    parts = [f"{n} for {', '.join(counts[n])}" for n in ranked[:-1]]
    return f"its seeds: {'; '.join(parts)}; {ranked[-1]} for the others"


def markdown_table(results: dict) -> str:
    config = results["config"]
    rules = f", NVFP4 scale rule {rule}" if (rule := scale_rules(results)) else ""
    seeds = seeds_run(results) or config.get("seeds", [config.get("seed")])
    lines = [
        f"Measured {measured(results)}; SmolLM2-135M-Instruct, LoRA r={config['r']}, "
        f"{config['steps']} steps of {config['batch']} per adapter, lr {config['lr']}, "
        f"seeds {seeds}, compute dtype {compute_dtype(config)}, "
        f"MeZO lr {config.get('mezo_lr', '-')}{rules}.",
        "",
    ]
    if results.get("complete") is False:
        users = [u["methods"] for w in results["workloads"].values() for u in w["users"].values()]
        runs = [len(m.get("pact", next(iter(m.values())))["seeds"]) for m in users]
        done = f"{sum(runs)} of {len(runs) * len(config.get('seeds', [0]))} user-seeds"
        lines[-1:] = [f"PARTIAL: an interrupted run ({done}); means over what has run (--resume ends it).", ""]
    for name, rows in results["summary"].items():
        n = next(iter(rows.values()))["users"] if rows else 0
        lines += [f"**{name}** ({n} users; means over users of each user's mean over {seed_counts(rows)})", "",
                  "| method | accuracy | macro-F1 | train s / user | steps | peak memory (GiB) |",
                  "|---|---|---|---|---|---|"]  # fmt: skip
        for method, r in rows.items():
            cells = [LABELS.get(method, method), _fmt(r["accuracy"], "{:.1%}"), _fmt(r["macro_f1"], "{:.3f}")]
            cells += [_fmt(r["train_s"], "{:.1f}"), _fmt(r["steps"], "{:.0f}"), _fmt(r["peak_gib"], "{:.2f}")]
            lines.append("| " + " | ".join(cells) + " |")
        for target, t in results["targets"].get(name, {}).items():
            se = f" +/- {t['se']:.1f}" if t["se"] is not None else ""
            verdict = "met" if t["met"] else "MISSED"
            if t["se"] and abs(t["points"] - t["least"]) < t["se"]:
                verdict += " (the target is within one SE of the mean: not resolved)"
            pairs = f", {t['users']} users, {t['pairs']} paired runs" if "pairs" in t else ""
            lines.append(f"\n{target}: {t['points']:+.1f}{se} points (target >= {t['least']:+.0f}{pairs}): {verdict}")
        lines.append("")
    agreement = results.get("qnn_agreement")
    if agreement and "steps" in agreement:
        where = f"{len(agreement['steps'])} steps on {agreement['user']}, same parameters"
        diff = f"loss within {agreement['max_loss_rel_diff']:.2%}, adapter gradients cosine >= "
        diff += f"{agreement['min_grad_cosine']:.6f}"
        if "grad_rel_error" in agreement["steps"][0]:
            diff += f", relative error <= {max(s['grad_rel_error'] for s in agreement['steps']):.2%}"
        lines.append(f"PACT on qnn (HTP emulator) vs the torch backend, {where}: {diff}.")
    return "\n".join(lines).rstrip()


def plot(results: dict, out: Path) -> list[str]:
    """accuracy_vs_wallclock.png and accuracy_vs_memory.png: one point per method, one panel per workload; a plot
    whose figure no method has (--no-memory: no peak memory) is not written."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("[eval] matplotlib is not installed: no plots (pip install 'optimum-pact[bench]')", file=sys.stderr)
        return []
    written = []
    summary = results["summary"]
    for key, xlabel, filename in (("train_s", "training wall-clock per user (s)", "accuracy_vs_wallclock.png"),
                                  ("peak_gib", "peak memory above idle (GiB)", "accuracy_vs_memory.png")):  # fmt: skip
        if all(r[key] is None for rows in summary.values() for r in rows.values()):
            continue
        fig, axes = plt.subplots(1, len(summary), figsize=(5.5 * len(summary), 4.2), squeeze=False)
        for ax, (name, rows) in zip(axes[0], summary.items()):
            for method, r in rows.items():
                if method == "majority":
                    ax.axhline(r["accuracy"], color="grey", linestyle="--", label=LABELS[method])
                    continue
                if r[key] is not None:
                    ax.scatter(r[key], r["accuracy"], label=LABELS.get(method, method), s=50)
            ax.set_title(f"{name} ({next(iter(rows.values()))['users']} users)")
            ax.set_xlabel(xlabel)
            ax.set_ylabel("held-out accuracy (mean over users)")
        axes[0][-1].legend(fontsize=7, loc="best")
        fig.suptitle(f"SmolLM2-135M personalization, {results['date']}, {results['machine']}", fontsize=9)
        fig.tight_layout()
        fig.savefig(out / filename, dpi=110)
        plt.close(fig)
        written.append(str(out / filename))
    return written
