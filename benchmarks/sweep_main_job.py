"""Sweep what `pact finetune` sets, over seeds, for its defaults (issue 41, item 3).

Each setting is a list of extra `pact finetune` flags; each (setting, seed) runs the installed console command in a
fresh process and keeps its held-out accuracy, final loss, steps and training time from summary.json. Accuracy does
not depend on the machine's load (same seed, same threads: the same run), so the sweep may share the machine; its
times are only comparable within one quiet sitting (bench_main_job.py measures those). The reference is stock peft
LoRA's accuracy per seed from a bench_main_job results file (--reference), paired by seed.

    python benchmarks/sweep_main_job.py [--settings default,warmup0,...] [--seeds 0 1 2 3 4] [--resume]
    python benchmarks/sweep_main_job.py --table benchmarks/results/main_job_sweep/results.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from datetime import date
from pathlib import Path

from bench_main_job import REF, mean_se, run_pact_finetune
from common import cpu_model, log

RESULTS = Path(__file__).resolve().parent / "results"
DEFAULT_OUTPUT = RESULTS / "main_job_sweep" / "results.json"
DEFAULT_REFERENCE = RESULTS / "main_job" / "results.json"
# name -> the flags `pact finetune` gets on top of its defaults
SETTINGS = {
    "default": [],
    "cosine": ["--lr_scheduler_type", "cosine"],
    "warmup0": ["--warmup_steps", "0"],
    "lr3e-3": ["--learning_rate", "3e-3"],
    "packed": ["--pact_padding_free", "true"],
    "padded": ["--pact_padding_free", "false"],
    "protect10": ["--pact_protect_fraction", "0.1"],
    "lr1e-3": ["--learning_rate", "1e-3"],
    "speed15": ["--pact_adapt", "speed", "--pact_adapt_top_blocks", "15"],
    # AQLoRA's quality setting: a fraction of the decoder linears kept 16-bit, ranked by NVFP4 error (the weights
    # alone, no calibration batch)
    "protect10_nvfp4": ["--pact_protect_fraction", "0.1", "--pact_rank_by", "nvfp4"],
    "protect25_nvfp4": ["--pact_protect_fraction", "0.25", "--pact_rank_by", "nvfp4"],
    "protect50_nvfp4": ["--pact_protect_fraction", "0.5", "--pact_rank_by", "nvfp4"],
}


def reference_accuracy(path: Path) -> dict[int, float]:
    """Stock peft LoRA's held-out accuracy per seed in a bench_main_job results file."""
    runs = json.loads(path.read_text())["runs"]
    return {r["seed"]: r["accuracy"] for r in runs if r["arm"] == REF}


def summarize(runs: list[dict], reference: dict[int, float]) -> dict:
    out = {}
    for name in dict.fromkeys(r["setting"] for r in runs):
        mine = [r for r in runs if r["setting"] == name]
        paired = [100 * (r["accuracy"] - reference[r["seed"]]) for r in mine if r["seed"] in reference]
        out[name] = {"flags": mine[0]["flags"], "seeds": sorted(r["seed"] for r in mine),
                     "accuracy_pct": mean_se([100 * r["accuracy"] for r in mine]),
                     "accuracy_diff_pts": mean_se(paired) if paired else None,
                     "final_loss": statistics.median(r["final_loss"] for r in mine),
                     "train_s": statistics.median(r["train_s"] for r in mine)}  # fmt: skip
    return out


def markdown_table(results: dict) -> str:
    ref = results["reference"]
    lines = [f"| setting | flags | seeds | held-out accuracy % | - {REF} (points, paired) | final loss (median) |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for name, entry in results["summary"].items():
        acc, diff = entry["accuracy_pct"], entry["accuracy_diff_pts"]
        se = f" ± {acc['se']:.1f}" if acc["se"] is not None else ""
        shown = f"{diff['mean']:+.1f}" + (f" ± {diff['se']:.1f}" if diff and diff["se"] is not None else "")
        flags = " ".join(entry["flags"]) or "(the defaults)"
        lines.append(f"| {name} | `{flags}` | {len(entry['seeds'])} | {acc['mean']:.1f}{se} | "
                     f"{shown if diff else 'n/a'} | {entry['final_loss']:.3f} |")  # fmt: skip
    lines += ["", f"- {REF} (stock peft LoRA + Trainer, the same rows): {ref['accuracy_pct']['mean']:.1f} "
              f"± {ref['accuracy_pct']['se']:.1f}% over seeds {ref['seeds']} ({ref['file']})"]  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--settings", default=",".join(SETTINGS), help="comma-separated, of: " + ", ".join(SETTINGS))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--reference", default=str(DEFAULT_REFERENCE), help="bench_main_job results with peft_lora")
    parser.add_argument("--output", default=str(DEFAULT_OUTPUT))
    parser.add_argument("--resume", action="store_true", help="keep --output's runs, skip them")
    parser.add_argument("--table", metavar="FILE", help="print the markdown table of a results file and exit")
    args = parser.parse_args()
    if args.table:
        print(markdown_table(json.loads(Path(args.table).read_text())))
        return
    names = [n for n in args.settings.split(",") if n]
    if unknown := set(names) - set(SETTINGS):
        parser.error(f"--settings: unknown {sorted(unknown)}; choose from {', '.join(SETTINGS)}")
    reference = reference_accuracy(Path(args.reference))
    from optimum_pact.files import write_text_atomic

    out = Path(args.output)
    previous = json.loads(out.read_text()) if args.resume and out.is_file() else {}
    runs = previous.get("runs", [])
    done = {(r["setting"], r["seed"]) for r in runs}
    ref_file = str(Path(args.reference).resolve().relative_to(RESULTS.parents[1]))
    ref_entry = {"file": ref_file, "seeds": sorted(reference),
                 "accuracy_pct": mean_se([100 * a for a in reference.values()])}  # fmt: skip
    results = {"bench": "main_job_sweep", "date": date.today().isoformat(), "cpu": cpu_model(), "dtype": args.dtype,
               "reference": ref_entry, "runs": runs}  # fmt: skip
    for seed in args.seeds:
        for name in names:
            if (name, seed) in done:
                continue
            start = time.perf_counter()
            run = run_pact_finetune(seed, args.dtype, None, extra=SETTINGS[name])
            run = {"setting": name, "flags": SETTINGS[name], **run}
            runs.append(run)
            results["summary"] = summarize(runs, reference)
            out.parent.mkdir(parents=True, exist_ok=True)
            write_text_atomic(out, json.dumps(results, indent=1) + "\n")
            log(f"seed {seed}: {name:>16} held-out {run['accuracy']:.1%}, loss {run['final_loss']:.3f} "
                f"({time.perf_counter() - start:.0f} s)")  # fmt: skip
    results["summary"] = summarize(runs, reference)
    print(markdown_table(results), file=sys.stderr)
    print(json.dumps({k: results[k] for k in ("bench", "date", "cpu", "dtype", "reference", "summary")}))


if __name__ == "__main__":
    main()
