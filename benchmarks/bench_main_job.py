"""The job a user runs, end to end: `pact finetune` against the same job in a stock Trainer (issue 41, item 4).

Arms, each a fresh process (so its peak RSS is its own), in an order rotated per seed:
  peft_lora      stock peft LoRA + stock transformers Trainer, the model loaded in --dtype
  peft_qlora     the same on a bitsandbytes nf4 base (prepare_model_for_kbit_training, --dtype compute)
  pact_dropin    the same stock Trainer script with LoraConfig -> peft_ext.PactConfig (same fields)
  pact_finetune  the real console command: `pact finetune --seed S --output TMP --dtype D`
  pact_finetune_padded / pact_finetune_packed  the same with --pact_padding_free false / true
  pact_finetune_fused  the same with --pact_fuse_cpu_ops true (its compile time inside the training time)
  peft_lora_dup  peft_lora again: its ratio to peft_lora is the noise floor
  peft_lora_nvfp4       peft_lora on the weights PACT's NVFP4 products use (each targeted linear's NVFP4
                        reconstruction, as FrozenLinear quantizes it): the drop-in's weights, so what the format costs
                        stock peft itself (pact_dropin computes the same gradients: tests/test_trains_as_stock.py)
  peft_lora_nvfp4_kept  the same with the main job's AQLoRA share (pact_protect_fraction, ranked by NVFP4 error) left
                        as it was: pact_finetune's weights with --rounding nearest
  peft_lora_gptq(_kept) the same two on the base rounded by GPTQ on the training items (`rounded_base.gptq_base`):
                        what `pact finetune --rounding gptq` (the default) trains on
Every arm trains on the main job's rows (`tokenize_examples` on the built-in notes' train items) with the main job's
defaults (`MAIN_JOB_DEFAULTS`: r, alpha, all linears, lr, batch, epochs, warmup; so the arms stay equal when they
change) and is scored the same way (`classify` + `accuracy` on the held-out items). Per arm and seed: the wall time
of `trainer.train()` (what pact's summary.json reports as train_seconds), held-out accuracy and peak RSS (VmHWM at
the end of the process; for pact_finetune the console command's own process). Ratios to peft_lora are paired by
seed. Results (runs, summary, machine) go to --output after every run; the last line printed is JSON.

The accuracy of the model as the person runs it (issue 49), beside the training-time one:
  stock arms     the saved adapter merged by stock peft into the base it was trained on (merge_and_unload)
  pact_finetune  its summary (the saved adapter as `pact generate` loads it), the same scored again here in another
                 process through PactModelForCausalLM, and the `pact export --format gguf` file scored by llama.cpp
                 (its size beside the all-NVFP4 GGUF of the same base)
and for pact_finetune the whole command's wall time (start to exit: loading, ranking, quantizing, training, scoring,
saving) beside train().

    python benchmarks/bench_main_job.py [--seeds 0 1 2 3 4] [--arms peft_lora,...] [--dtype bfloat16] [--resume]
    python benchmarks/bench_main_job.py --seeds 0 --max-steps 2 --output /tmp/mj_smoke.json    # smoke test
    python benchmarks/bench_main_job.py --table benchmarks/results/main_job/results.json       # markdown table
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

from common import cpu_model, log, machine, round_linears, status_bytes  # lscpu's model and AMX; /proc

ARMS = (
    "peft_lora", "peft_qlora", "pact_dropin", "pact_finetune", "peft_lora_dup", "pact_finetune_padded",
    "pact_finetune_packed", "pact_finetune_fused", "peft_lora_nvfp4", "peft_lora_nvfp4_kept",
    "peft_lora_gptq", "peft_lora_gptq_kept",
)  # fmt: skip
# the pact_finetune variants: the flags each adds to `pact finetune`
ARM_FLAGS = {
    "pact_finetune_padded": ["--pact_padding_free", "false"],
    "pact_finetune_packed": ["--pact_padding_free", "true"],
    "pact_finetune_fused": ["--pact_fuse_cpu_ops", "true"],
}
DEFAULT_ARMS = ARMS[:5]
# the GGUF merges scored for pact_finetune (rounding / what is rounded): the export's default first (its figure), then
# the merge before issue 49 (nearest rounding of the full-precision weights + the change)
# the GGUF's merges, `pact export`'s default first: rounding, what is rounded, size budget (1.0: no linear kept
# 16-bit beyond those trained so)
MERGES = (("gptq", "nvfp4", 1.3), ("gptq", "nvfp4", 1.0), ("nearest", "original", 1.0))
REF = "peft_lora"
NOISE = "peft_lora_dup"
DEFAULT_OUTPUT = Path(__file__).resolve().parent / "results" / "main_job" / "results.json"
# The targets for pact_finetune against peft_lora: (summary key, comparison, bound, words)
TARGETS = (
    ("time_ratio", "<=", 0.85, "training time <= 0.85x peft_lora"),
    ("accuracy_diff_pts", ">=", -1.0, "held-out accuracy >= peft_lora - 1 point"),
    ("rss_ratio", "<=", 1.0, "peak RSS <= peft_lora's"),
)
# issue 51's, at 1.5B: (summary key, comparison, bound, words); the GGUF's against the use path and its source file
TARGETS_LARGE = (
    ("time_ratio", "<=", 1.0, "training time <= 1.00x peft_lora"),
    ("as_used_diff_pts", ">=", -1.0, "as-used accuracy >= peft_lora's merged model - 1 point"),
    ("rss_ratio", "<=", 0.40, "peak RSS <= 0.40x peft_lora's"),
)


def job_settings(model_name: str | None = None) -> dict:
    """The main job's LoRA and Trainer defaults every arm uses, for `model_name` (a named model may have its own:
    `main_job_defaults`); output_dir and seed are per run."""
    from optimum_pact.commands.arguments import MAIN_JOB_DEFAULTS, main_job_defaults

    settings = {**MAIN_JOB_DEFAULTS, **main_job_defaults(model_name)}
    return {k: v for k, v in settings.items() if k not in ("output_dir", "seed")}


# ---- one arm in this process (--arm) ----


def rounded(model, keep_fraction: float):
    """`model` with its decoder linears' weights replaced by their NVFP4 reconstruction (`fake_quantize`: what a
    FrozenLinear built from them computes with, bit for bit), the `keep_fraction` with the largest NVFP4 error left as
    they are (AQLoRA's rank_by="nvfp4" list)."""
    from optimum_pact.nvfp4 import fake_quantize
    from peft_ext.ranking import choose_protected

    round_linears(model, fake_quantize, choose_protected(model, keep_fraction, "nvfp4") if keep_fraction else ())
    return model


def gptq_rounded(model, tokenizer, keep_fraction: float):
    """`rounded`, but each rounded linear by GPTQ on the main job's training items, as `pact finetune --rounding
    gptq` rounds its base (`rounded_base.gptq_base`, the same codes)."""
    import torch

    from optimum_pact.commands.calibration import calibration_rows
    from optimum_pact.commands.rounded_base import gptq_base
    from peft_ext.blocks import decoder_linears
    from peft_ext.ranking import choose_protected

    keep = set(choose_protected(model, keep_fraction, "nvfp4") if keep_fraction else ())
    codes = gptq_base(model, calibration_rows(tokenizer, None), model.name_or_path)
    with torch.no_grad():
        for name, linear in decoder_linears(model).items():
            if name not in keep:
                linear.weight.copy_(codes[name].dequantize())
    return model


def run_trainer_arm(
    arm: str, seed: int, dtype_name: str, max_steps: int | None, model_name: str | None = None
) -> dict:
    """A stock transformers Trainer on the main job's rows; the adapter is peft's LoRA, on nf4 for peft_qlora, or
    PactConfig for pact_dropin."""
    import tempfile

    import torch
    from datasets import Dataset
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, DataCollatorForSeq2Seq, Trainer, TrainingArguments

    from optimum_pact.commands.arguments import LORA_FIELDS
    from optimum_pact.commands.data import load_personal_dataset
    from optimum_pact.commands.evaluation import accuracy, classify
    from optimum_pact.commands.finetune import tokenize_examples
    from optimum_pact.commands.model_folder import load_tokenizer, resolve_model
    from peft_ext import PactConfig

    settings, dtype = job_settings(model_name), getattr(torch, dtype_name)
    model_path = resolve_model(model_name)
    tokenizer = load_tokenizer(model_path, model_name)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    train_items, heldout_items = load_personal_dataset()
    if arm == "peft_qlora":
        from peft import prepare_model_for_kbit_training
        from transformers import BitsAndBytesConfig

        quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype)
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, quantization_config=quant)
        # no gradient checkpointing: no other arm recomputes activations
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
    keep = settings["pact_protect_fraction"] if arm.endswith("_kept") else 0.0
    if arm.startswith("peft_lora_nvfp4"):
        model = rounded(model, keep)
    if arm.startswith("peft_lora_gptq"):
        model = gptq_rounded(model, tokenizer, keep)
    lora = {k: settings[k] for k in LORA_FIELDS if k in settings}
    torch.manual_seed(seed)  # as the main job seeds before get_peft_model
    model = get_peft_model(model, (PactConfig if arm == "pact_dropin" else LoraConfig)(**lora))
    fields = set(TrainingArguments.__dataclass_fields__)
    trainer_settings = {k: v for k, v in settings.items() if k in fields}
    with tempfile.TemporaryDirectory() as tmp:
        run = {**trainer_settings, "report_to": "none", "save_strategy": "no", "use_cpu": True}
        args = TrainingArguments(output_dir=tmp, seed=seed, max_steps=max_steps or -1, **run)
        collator = DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=-100)
        rows = Dataset.from_list(tokenize_examples(tokenizer, train_items))
        trainer = Trainer(model=model, args=args, train_dataset=rows, data_collator=collator)
        start = time.perf_counter()
        result = trainer.train()
        train_s = time.perf_counter() - start
    # bitsandbytes repacks a Linear4bit weight in eval() + no_grad (FACTS). SmolLM2's out_features are multiples of
    # 32, where the repack works: its nf4 scores under no_grad equal those under enable_grad (checked, max diff 0.0),
    # so every arm is scored the same way, under classify's no_grad
    labels = sorted({item["label"] for item in train_items + heldout_items})  # as finetune.py's HeldOut
    texts, golds = [i["text"] for i in heldout_items], [i["label"] for i in heldout_items]
    acc = accuracy(classify(model, tokenizer, texts, labels), golds)
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    peak = status_bytes("VmHWM") / 2**30  # of training and its scoring; the merge below is after it
    with tempfile.TemporaryDirectory() as tmp:  # as the person runs it: the saved adapter merged into its base
        model.save_pretrained(tmp)
        del model, trainer
        from peft import PeftModel

        base = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
        base = rounded(base, keep) if arm.startswith("peft_lora_nvfp4") else base  # the base it was trained on
        base = gptq_rounded(base, tokenizer, keep) if arm.startswith("peft_lora_gptq") else base
        merged = PeftModel.from_pretrained(base, tmp).merge_and_unload()
        as_used = accuracy(classify(merged, tokenizer, texts, labels), golds)
    return {"arm": arm, "seed": seed, "train_s": train_s, "accuracy": acc, "as_used_accuracy": as_used,
            "steps": result.global_step, "final_loss": losses[-1] if losses else result.training_loss,
            "peak_rss_gib": peak}  # fmt: skip


def run_pact_finetune(
    seed: int,
    dtype_name: str,
    max_steps: int | None,
    arm: str = "pact_finetune",
    extra: list[str] = (),
    model_name: str | None = None,
) -> dict:
    """The installed `pact finetune` console command (with `extra` flags); time and accuracy from its summary.json,
    peak RSS its process's (ru_maxrss of that child alone, from wait4: VmHWM at its exit)."""
    import tempfile

    pact = Path(sys.executable).with_name("pact")
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [str(pact), "finetune", "--seed", str(seed), "--output", tmp, "--dtype", dtype_name]
        cmd += ["--max_steps", str(max_steps)] if max_steps else []
        cmd += ARM_FLAGS.get(arm, [])
        cmd += ["--model", model_name] if model_name else []
        cmd += list(extra)
        start = time.perf_counter()
        child = subprocess.Popen(cmd, stdout=sys.stderr)  # its summary text: beside the progress, not our JSON
        # wait4: this child's own rusage; RUSAGE_CHILDREN would be the largest of every child waited for so far
        _, status, usage = os.wait4(child.pid, 0)
        wall_s = time.perf_counter() - start
        child.returncode = code = os.waitstatus_to_exitcode(status)
        if code:
            raise subprocess.CalledProcessError(code, cmd)
        summary = json.loads((Path(tmp) / "summary.json").read_text())
        used = as_used(Path(tmp) / "adapter", MERGES if model_name is None else MERGES[:1])
    peak = usage.ru_maxrss * 1024
    return {"arm": arm, "seed": seed, "train_s": summary["train_seconds"], "wall_s": wall_s,
            "accuracy": summary["accuracy_after"], "steps": summary["steps"], "final_loss": summary["final_loss"],
            "peak_rss_gib": peak / 2**30, "summary_peak_rss_gib": summary["peak_rss_gib"], **used}  # fmt: skip


def as_used(adapter: Path, merges=MERGES) -> dict:
    """A pact adapter as the person runs it: through PactModelForCausalLM (what `pact generate` loads, here in another
    process than the one that trained it) and as the `pact export --format gguf` file in llama.cpp."""
    import tempfile

    from optimum_pact.commands.data import load_personal_dataset
    from optimum_pact.commands.evaluation import accuracy, classify
    from optimum_pact.commands.gguf_export import export_gguf
    from optimum_pact.commands.llama_score import llama_cpp_accuracy
    from optimum_pact.commands.modeling import PactModelForCausalLM

    train_items, heldout_items = load_personal_dataset()
    labels = sorted({item["label"] for item in train_items + heldout_items})
    texts, golds = [i["text"] for i in heldout_items], [i["label"] for i in heldout_items]
    model = PactModelForCausalLM.from_pretrained(adapter=str(adapter))
    use_path = accuracy(classify(model.model, model.tokenizer, texts, labels), golds)
    tokenizer = model.tokenizer
    del model
    variants, sizes = {}, []
    with tempfile.TemporaryDirectory() as tmp:
        for rounding, source, budget in merges:
            gguf = Path(tmp) / f"{rounding}-{source}-{budget}.gguf"
            export_gguf(adapter, gguf, score=False, rounding=rounding, requantize_from=source, size_budget=budget)
            variants[f"{rounding}/{source}/{budget}"] = llama_cpp_accuracy(gguf, tokenizer, heldout_items, labels)
            sizes.append(gguf.stat().st_size)
    size = sizes[0]
    return {"as_used_accuracy": use_path, "gguf_accuracy": next(iter(variants.values())), "gguf_bytes": size,
            "gguf_variants": variants}  # fmt: skip


def all_nvfp4_gguf_bytes(model_name: str | None = None) -> int:
    """The size of the model's GGUF with every linear NVFP4 (what a protection-free adapter merges into)."""
    import tempfile

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from optimum_pact.commands.gguf_export import write_gguf
    from optimum_pact.commands.model_folder import resolve_model
    from optimum_pact.commands.nvfp4_merge import save_nvfp4_folder
    from optimum_pact.quantizer import PactQuantizationConfig

    path = resolve_model(model_name)
    with tempfile.TemporaryDirectory() as tmp:
        model = AutoModelForCausalLM.from_pretrained(path, quantization_config=PactQuantizationConfig())
        save_nvfp4_folder(model, AutoTokenizer.from_pretrained(path), Path(tmp) / "model")
        return write_gguf(Path(tmp) / "model", Path(tmp) / "model.gguf").stat().st_size


# ---- the parent: runs, summary, table ----


def mean_se(values: list[float]) -> dict:
    n = len(values)
    se = statistics.stdev(values) / math.sqrt(n) if n > 1 else None
    return {"mean": statistics.fmean(values), "se": se, "n": n}


def summarize(runs: list[dict]) -> dict:
    """Per arm: median train time, accuracy mean +/- SE over seeds (points), median peak RSS; against peft_lora,
    paired by seed: the median of per-seed time and RSS ratios and mean +/- SE of the accuracy differences."""
    by = {(r["arm"], r["seed"]): r for r in runs}
    out = {}
    for arm in [a for a in ARMS if any(r["arm"] == a for r in runs)]:
        mine = [r for r in runs if r["arm"] == arm]
        entry = {"seeds": sorted(r["seed"] for r in mine),
                 "train_s": statistics.median(r["train_s"] for r in mine),
                 "accuracy_pct": mean_se([100 * r["accuracy"] for r in mine]),
                 "peak_rss_gib": statistics.median(r["peak_rss_gib"] for r in mine)}  # fmt: skip
        for key in ("as_used_accuracy", "gguf_accuracy"):  # the model as the person runs it (issue 49)
            if all(key in r for r in mine):
                entry[key + "_pct"] = mean_se([100 * r[key] for r in mine])
        if all("wall_s" in r for r in mine):
            entry["wall_s"] = statistics.median(r["wall_s"] for r in mine)
        if all("gguf_bytes" in r for r in mine):
            entry["gguf_mb"] = statistics.median(r["gguf_bytes"] for r in mine) / 1e6
        pairs = [(by[arm, r["seed"]], by[REF, r["seed"]]) for r in mine if (REF, r["seed"]) in by]
        if arm != REF and pairs:
            entry["vs_" + REF] = {
                "seeds": len(pairs),
                "time_ratio": statistics.median(a["train_s"] / b["train_s"] for a, b in pairs),
                "rss_ratio": statistics.median(a["peak_rss_gib"] / b["peak_rss_gib"] for a, b in pairs),
                "accuracy_diff_pts": mean_se([100 * (a["accuracy"] - b["accuracy"]) for a, b in pairs]),
            }
            if all("as_used_accuracy" in a and "as_used_accuracy" in b for a, b in pairs):
                diffs = [100 * (a["as_used_accuracy"] - b["as_used_accuracy"]) for a, b in pairs]
                entry["vs_" + REF]["as_used_diff_pts"] = mean_se(diffs)
            if all("gguf_accuracy" in a and "as_used_accuracy" in b for a, b in pairs):
                diffs = [100 * (a["gguf_accuracy"] - b["as_used_accuracy"]) for a, b in pairs]
                entry["vs_" + REF]["gguf_diff_pts"] = mean_se(diffs)  # the phone file against stock's merged model
        if "gguf_accuracy" in mine[0]:  # the phone file against what the summary showed, seed by seed
            gaps = [100 * (r["gguf_accuracy"] - r["accuracy"]) for r in mine]
            entry["gguf_minus_summary_pts"] = {**mean_se(gaps), "worst": min(gaps)}
            entry["summary_equals_use_path"] = all(r["accuracy"] == r["as_used_accuracy"] for r in mine)
        out[arm] = entry
    return out


def targets(summary: dict, all_nvfp4_bytes: int | None = None, source_gguf_bytes: int | None = None) -> dict:
    """The issues' targets for pact_finetune against peft_lora, each with its value and whether it was met; with
    `source_gguf_bytes` (a named model's own GGUF, `--model`), issue 51's targets at that size."""
    pact = summary.get("pact_finetune", {})
    vs = pact.get("vs_" + REF)
    if vs is None:
        return {}
    out = {}
    for key, op, bound, words in TARGETS if source_gguf_bytes is None else TARGETS_LARGE:
        if key not in vs:
            continue
        value = vs[key]["mean"] if isinstance(vs[key], dict) else vs[key]
        met = value <= bound if op == "<=" else value >= bound
        out[key] = {"value": value, "target": f"{op} {bound:g}", "met": met, "words": words}
    gaps = pact.get("gguf_minus_summary_pts")
    if gaps is not None and source_gguf_bytes is not None:  # issue 51
        value = pact["gguf_accuracy_pct"]["mean"] - pact["as_used_accuracy_pct"]["mean"]
        out["gguf_minus_use_path_pts"] = {"value": value, "target": ">= -1", "met": value >= -1.0,
                                          "words": "GGUF in llama.cpp >= the use path - 1 point (mean)"}  # fmt: skip
        value = pact["gguf_mb"] * 1e6 / source_gguf_bytes
        out["gguf_size_vs_source"] = {"value": value, "target": "<= 1.1", "met": value <= 1.1,
                                      "words": "GGUF size <= 1.1x the model's own Q4_K_M file"}  # fmt: skip
        return out
    if gaps is not None:  # issue 49
        out["summary_equals_use_path"] = {"value": pact["summary_equals_use_path"], "target": "== True",
                                          "met": pact["summary_equals_use_path"],
                                          "words": "summary accuracy == use-path accuracy on every seed"}  # fmt: skip
        out["gguf_minus_summary_pts"] = {"value": gaps["mean"], "target": ">= -1", "met": gaps["mean"] >= -1.0,
                                         "words": "GGUF in llama.cpp >= the summary - 1 point (mean)"}  # fmt: skip
        worst = {"value": gaps["worst"], "target": ">= -3", "met": gaps["worst"] >= -3}
        out["gguf_worst_minus_summary_pts"] = {
            **worst,
            "words": "GGUF in llama.cpp >= the summary - 3 points (every seed)",
        }
    if "gguf_diff_pts" in vs:
        value = vs["gguf_diff_pts"]["mean"]
        out["gguf_diff_pts"] = {"value": value, "target": ">= -1", "met": value >= -1.0,
                                "words": "GGUF in llama.cpp >= stock peft's merged model - 1 point"}  # fmt: skip
    if all_nvfp4_bytes and "gguf_mb" in pact:
        value = pact["gguf_mb"] * 1e6 / all_nvfp4_bytes
        out["gguf_size_ratio"] = {"value": value, "target": "<= 1.3", "met": value <= 1.3,
                                  "words": "GGUF size <= 1.3x the all-NVFP4 one"}  # fmt: skip
    return out


def _pm(value: dict, digits: int = 1, sign: str = "") -> str:
    se = f" ± {value['se']:.{digits}f}" if value["se"] is not None else ""
    return f"{value['mean']:{sign}.{digits}f}{se}"


def markdown_table(results: dict) -> str:
    """The summary as a markdown table, then the issue's targets and the noise floor."""
    summary, vs_key = results["summary"], "vs_" + REF
    used = any("as_used_accuracy_pct" in entry for entry in summary.values())
    extra = (
        " as used % (merged; pact: use path) | as used - {0} | GGUF in llama.cpp % | whole command s |" if used else ""
    )
    lines = [f"| arm | seeds | train s (median) | time / {REF} | held-out accuracy % | accuracy - {REF} (points) "
             f"| peak RSS GiB | RSS / {REF} |{extra.format(REF)}", "|---" * (8 + 4 * used) + "|"]  # fmt: skip
    for arm, entry in summary.items():
        vs = entry.get(vs_key)
        ratio = f"{vs['time_ratio']:.3f}" if vs else "1"
        diff = _pm(vs["accuracy_diff_pts"], sign="+") if vs else "0"
        rss = f"{vs['rss_ratio']:.3f}" if vs else "1"
        row = (f"| {arm} | {len(entry['seeds'])} | {entry['train_s']:.1f} | {ratio} | "
               f"{_pm(entry['accuracy_pct'])} | {diff} | {entry['peak_rss_gib']:.2f} | {rss} |")  # fmt: skip
        if used:
            as_used = _pm(entry["as_used_accuracy_pct"]) if "as_used_accuracy_pct" in entry else "-"
            used_diff = (
                _pm(vs["as_used_diff_pts"], sign="+") if vs and "as_used_diff_pts" in vs else "0" if not vs else "-"
            )
            gguf = (f"{_pm(entry['gguf_accuracy_pct'])} ({entry['gguf_mb']:.0f} MB)"
                    if "gguf_accuracy_pct" in entry else "-")  # fmt: skip
            wall = f"{entry['wall_s']:.1f}" if "wall_s" in entry else "-"
            row += f" {as_used} | {used_diff} | {gguf} | {wall} |"
        lines.append(row)
    lines.append("")
    for key, target in results.get("targets", {}).items():
        value = target["value"]
        shown = (f"{value:+.1f} points" if key.endswith("_pts") else str(value) if isinstance(value, bool)
                 else f"{value:.3f}x")  # fmt: skip
        lines.append(f"- target, pact_finetune {target['words']}: {shown} ({'met' if target['met'] else 'missed'})")
    noise = summary.get(NOISE, {}).get(vs_key)
    if noise:
        time_rss = f"time {noise['time_ratio']:.3f}x, RSS {noise['rss_ratio']:.3f}x"
        lines.append(f"- noise floor ({NOISE} / {REF}): {time_rss}")
    return "\n".join(lines)


def versions() -> dict:
    from importlib.metadata import version

    return {name: version(name) for name in ("torch", "transformers", "peft", "bitsandbytes", "optimum-pact")}


def save(results: dict, out: Path) -> None:
    from optimum_pact.files import write_text_atomic

    results["summary"] = summarize(results["runs"])
    results["targets"] = targets(
        results["summary"], results.get("all_nvfp4_gguf_bytes"), results.get("source_gguf_bytes")
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out, json.dumps(results, indent=1) + "\n")


def run_child(arm: str, seed: int, args) -> dict:
    cmd = [sys.executable, __file__, "--arm", arm, "--seed", str(seed), "--dtype", args.dtype]
    cmd += ["--max-steps", str(args.max_steps)] if args.max_steps else []
    cmd += ["--model", args.model] if args.model else []
    out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True).stdout  # stderr: progress, shown
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arm", choices=ARMS, help=argparse.SUPPRESS)  # internal: run one arm in this process
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)  # internal: with --arm
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--arms", default=",".join(DEFAULT_ARMS), help="comma-separated, of: " + ", ".join(ARMS))
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                        help="every arm's model dtype; float32 on CPUs without native bf16 (AVX2 only)")  # fmt: skip
    parser.add_argument("--model", default=None, help="the model every arm trains (default: the main job's); a "
                        "folder, Hub id or named model such as qwen2.5-coder-1.5b")  # fmt: skip
    parser.add_argument("--max-steps", type=int, default=None, help="stop training after this many steps (smoke)")
    parser.add_argument("--output", default=str(DEFAULT_OUTPUT), help="results file (JSON), written after every run")
    parser.add_argument("--resume", action="store_true", help="keep --output's runs of the same settings, skip them")
    parser.add_argument("--table", metavar="FILE", help="print the markdown table of a results file and exit")
    args = parser.parse_args()
    if args.table:
        print(markdown_table(json.loads(Path(args.table).read_text())))
        return
    if args.arm:
        if args.arm.startswith("pact_finetune"):
            run = run_pact_finetune(args.seed, args.dtype, args.max_steps, args.arm, model_name=args.model)
        else:
            run = run_trainer_arm(args.arm.removesuffix("_dup"), args.seed, args.dtype, args.max_steps, args.model)
        print(json.dumps(run | {"arm": args.arm}))
        return

    arms = [a for a in args.arms.split(",") if a]
    if unknown := set(arms) - set(ARMS):
        parser.error(f"--arms: unknown {sorted(unknown)}; choose from {', '.join(ARMS)}")
    from resume import check_settings

    from optimum_pact.commands.model_folder import resolve_model
    from optimum_pact.commands.named_models import named_model

    config = {
        "dtype": args.dtype,
        "max_steps": args.max_steps,
        "model": resolve_model(args.model),
        "job": job_settings(args.model),
    }
    out = Path(args.output)
    previous = json.loads(out.read_text()) if args.resume and out.is_file() else {}
    if previous:
        check_settings(out, previous["config"], config)
    where = machine()
    piece = {"machine": where, "date": date.today().isoformat(), "seeds": args.seeds, "arms": arms}
    results = {"bench": "main_job", "config": config, "machine": where, "cpu": cpu_model(), "date": piece["date"],
               "versions": versions(), "pieces": previous.get("pieces", []),
               "runs": previous.get("runs", [])}  # fmt: skip
    named = named_model(args.model) if args.model else None
    if named is not None and named.gguf.endswith("q4_k_m.gguf"):  # the file the model came from: issue 51's size
        results["source_gguf_bytes"] = named.size
    if previous.get("all_nvfp4_gguf_bytes"):  # kept when this sitting runs only other arms
        results["all_nvfp4_gguf_bytes"] = previous["all_nvfp4_gguf_bytes"]
    elif any(arm.startswith("pact_finetune") for arm in arms):  # what the GGUF's size is measured against
        results["all_nvfp4_gguf_bytes"] = all_nvfp4_gguf_bytes(args.model)
    done = {(r["arm"], r["seed"]) for r in results["runs"]}
    start = time.perf_counter()
    for i, seed in enumerate(args.seeds):
        order = arms[i % len(arms) :] + arms[: i % len(arms)]  # rotated: no arm always runs first or last
        for arm in order:
            if (arm, seed) in done:
                log(f"seed {seed}: {arm:>13} kept from {out}")
                continue
            run = run_child(arm, seed, args)
            if not any(p is piece for p in results["pieces"]):  # a sitting is recorded once it has run something
                results["pieces"].append(piece)
            results["runs"].append(run)
            piece["wall_s"] = time.perf_counter() - start
            save(results, out)
            log(f"seed {seed}: {arm:>13} train {run['train_s']:.1f} s ({run['steps']} steps), held-out "
                f"{run['accuracy']:.1%}, peak RSS {run['peak_rss_gib']:.2f} GiB")  # fmt: skip
    save(results, out)
    print(markdown_table(results))
    line = {k: results[k] for k in ("bench", "date", "cpu", "versions", "config", "summary", "targets")}
    print(json.dumps({**line, "output": str(out)}))


if __name__ == "__main__":
    main()
