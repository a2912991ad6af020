"""benchmarks/bench_main_job.py's pure parts: the summary and ratio math on fake runs, the targets, the table."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))

import bench_main_job as bench  # noqa: E402


def run(arm, seed, train_s, accuracy, rss):
    return {"arm": arm, "seed": seed, "train_s": train_s, "accuracy": accuracy, "peak_rss_gib": rss, "steps": 60}


RUNS = [
    run("peft_lora", 0, 20.0, 0.90, 1.40),
    run("peft_lora", 1, 30.0, 0.95, 1.40),
    run("peft_lora", 2, 10.0, 0.80, 1.20),
    run("pact_finetune", 0, 16.0, 0.90, 1.26),
    run("pact_finetune", 1, 21.0, 0.90, 1.40),
    run("pact_finetune", 2, 9.0, 0.85, 1.32),
    run("pact_finetune", 3, 5.0, 0.10, 0.10),  # no peft_lora run of seed 3: left out of every paired figure
    run("peft_lora_dup", 0, 22.0, 0.90, 1.40),
]


def test_summary_per_arm():
    summary = bench.summarize(RUNS)
    assert list(summary) == ["peft_lora", "pact_finetune", "peft_lora_dup"]  # ARMS order, present arms only
    lora = summary["peft_lora"]
    assert lora["seeds"] == [0, 1, 2] and lora["train_s"] == 20.0 and lora["peak_rss_gib"] == 1.40
    assert lora["accuracy_pct"]["mean"] == pytest.approx(88.3333, abs=1e-3)
    assert lora["accuracy_pct"]["se"] == pytest.approx(4.4096, abs=1e-3)  # stdev 7.638 / sqrt(3)
    assert "vs_peft_lora" not in lora
    assert summary["pact_finetune"]["train_s"] == pytest.approx(12.5)  # median of 4 runs, seed 3 included


def test_ratios_are_paired_by_seed():
    vs = bench.summarize(RUNS)["pact_finetune"]["vs_peft_lora"]
    assert vs["seeds"] == 3
    assert vs["time_ratio"] == pytest.approx(0.8)  # median of 0.8, 0.7, 0.9
    assert vs["rss_ratio"] == pytest.approx(1.0)  # median of 0.9, 1.0, 1.1
    diff = vs["accuracy_diff_pts"]  # 0, -5, +5 points
    assert diff["mean"] == pytest.approx(0.0, abs=1e-9) and diff["se"] == pytest.approx(5 / 3**0.5)
    noise = bench.summarize(RUNS)["peft_lora_dup"]["vs_peft_lora"]
    assert noise["seeds"] == 1 and noise["time_ratio"] == pytest.approx(1.1)
    assert noise["accuracy_diff_pts"]["se"] is None  # one pair: no spread to estimate


def test_targets():
    found = bench.targets(bench.summarize(RUNS))
    assert found["time_ratio"]["met"] and found["time_ratio"]["value"] == pytest.approx(0.8)
    assert found["accuracy_diff_pts"]["met"] and found["rss_ratio"]["met"]
    slower = [dict(r, train_s=r["train_s"] * 1.2) if r["arm"] == "pact_finetune" else r for r in RUNS]
    assert not bench.targets(bench.summarize(slower))["time_ratio"]["met"]  # 0.96x > 0.85x
    worse = [dict(r, accuracy=r["accuracy"] - 0.02) if r["arm"] == "pact_finetune" else r for r in RUNS]
    assert not bench.targets(bench.summarize(worse))["accuracy_diff_pts"]["met"]  # -2 points
    assert bench.targets(bench.summarize([r for r in RUNS if r["arm"] == "peft_lora"])) == {}


def test_markdown_table(tmp_path):
    summary = bench.summarize(RUNS)
    results = {"runs": RUNS, "summary": summary, "targets": bench.targets(summary)}
    table = bench.markdown_table(results)
    lines = table.splitlines()
    assert lines[0].startswith("| arm | seeds | train s (median) |") and lines[1].count("|") == lines[0].count("|")
    assert "| peft_lora | 3 | 20.0 | 1 | 88.3 ± 4.4 | 0 | 1.40 | 1 |" in lines
    assert "| pact_finetune | 4 | 12.5 | 0.800 | 68.8 ± 19.6 | +0.0 ± 2.9 | 1.29 | 1.000 |" in lines
    assert "| peft_lora_dup | 1 | 22.0 | 1.100 | 90.0 | +0.0 | 1.40 | 1.000 |" in lines
    assert "- target, pact_finetune training time <= 0.85x peft_lora: 0.800x (met)" in lines
    assert "- noise floor (peft_lora_dup / peft_lora): time 1.100x, RSS 1.000x" in lines
    path = tmp_path / "results.json"
    path.write_text(json.dumps(results))
    printed = subprocess.run(
        [sys.executable, str(BENCH / "bench_main_job.py"), "--table", str(path)], capture_output=True, text=True
    )
    assert printed.returncode == 0, printed.stderr
    assert printed.stdout.strip() == table
