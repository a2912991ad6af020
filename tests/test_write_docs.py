"""docs/benchmarks.md is generated from the committed results files (benchmarks/write_docs.py); no model is loaded."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import docs_header  # noqa: E402
import write_docs  # noqa: E402


def test_docs_benchmarks_md_is_what_the_committed_results_give():
    proc = subprocess.run(
        [sys.executable, "benchmarks/write_docs.py", "--check"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, f"{proc.stderr.strip()} (then commit docs/benchmarks.md)"


def test_every_section_names_its_command_machine_and_date():
    text = write_docs.render()
    sections = text.split("\n## ")[1:]
    assert len(sections) == len(write_docs.results_files())
    for body in sections:
        # a script of benchmarks/, run directly or under the AVX2 cap (an emulated AVX2-only CPU)
        assert re.search(r"- written by: `(sh benchmarks/avx2_only\.sh )?python benchmarks/", body), body[:200]
        assert "AMX" in body and ("- date: 20" in body or "  - 20" in body), body[:400]


def test_a_main_job_section_names_every_arm_its_results_ran():
    """A section rendered by another section's function shows another table: the emulated-AVX2 main job once showed
    the format table (its arms pact_finetune, peft_qlora, peft_lora_dup nowhere in it; a section that names its arms
    otherwise lists them in its command's --arms)."""
    for folder, path in write_docs.results_files().items():
        results = json.loads(path.read_text())
        if results.get("bench") != "main_job":
            continue
        spec = write_docs.SECTIONS[folder]
        body = docs_header.header(spec, results) + spec.render(results)
        missing = sorted({run["arm"] for run in results["runs"]} - set(re.findall(r"[a-z][a-z0-9_]+", body)))
        assert not missing, f"section {folder} does not show arms {missing}"


def test_a_stale_page_fails_the_check(tmp_path, monkeypatch, capsys):
    stale = tmp_path / "benchmarks.md"
    stale.write_text(write_docs.render().replace("PACT", "PACT, edited by hand", 1))
    monkeypatch.setattr(write_docs, "OUTPUT", stale)
    assert write_docs.main(["--check"]) == 1
    assert "is stale: run python benchmarks/write_docs.py" in capsys.readouterr().err
    assert write_docs.main([]) == 0 and write_docs.main(["--check"]) == 0


def test_a_results_file_without_a_section_is_an_error_naming_the_fix(tmp_path, monkeypatch):
    (tmp_path / "new_bench").mkdir()
    (tmp_path / "new_bench" / "results.json").write_text(json.dumps({"machine": "x", "date": "2026-12-06"}))
    monkeypatch.setattr(write_docs, "RESULTS", tmp_path)
    with pytest.raises(SystemExit, match=r"no section for benchmarks/results/new_bench/results.json: add a function"):
        write_docs.render()


def test_recorded_machines_read_the_same_in_both_styles():
    assert docs_header.cpu_words("AMD EPYC; amx=False; avx512_bf16=True") == "AMD EPYC (no AMX, AVX512-BF16)"
    assert docs_header.cpu_words("Xeon (AMX, AVX-512, AVX512-BF16)") == "Xeon (AMX, AVX-512, AVX512-BF16)"
    machine = "x86_64, 2 CPU cores, Linux; AMD EPYC (no AMX, AVX2)"
    assert docs_header.machine_words(machine) == "AMD EPYC (no AMX, AVX2), 2 CPU cores, x86_64 Linux"
