"""`pact finetune`: clear errors for bad input, and (slow) the main job end to end on the real model."""

import dataclasses
import json

import pytest

from optimum_pact.backends.qnn import is_qnn_available
from optimum_pact.commands.arguments import DATACLASSES, build_parser, parse_finetune_args
from optimum_pact.commands.cli import main
from peft_ext import PactConfig, PactOptions
from trainer_callbacks import PactTrainingArguments


def test_missing_model_path_is_a_clear_error(capsys):
    assert main(["finetune", "--model", "./no/such/model"]) == 2
    err = capsys.readouterr().err
    assert "--model './no/such/model' does not exist" in err


def test_data_file_with_missing_field_is_a_clear_error(tmp_path, capsys):
    data = tmp_path / "items.jsonl"
    data.write_text('{"text": "buy milk", "label": "errand"}\n{"text": "call mum"}\n')
    assert main(["finetune", "--data", str(data)]) == 2
    err = capsys.readouterr().err
    assert "line 2" in err and "label" in err


def test_unknown_backend_is_a_clear_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["finetune", "--backend", "npu"])
    assert exit_info.value.code == 2
    assert "--backend: invalid choice: 'npu'" in capsys.readouterr().err


@pytest.mark.slow
def test_main_job_end_to_end(main_job):
    out, proc = main_job
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "PACT fine-tune summary" in proc.stdout and "held-out accuracy" in proc.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["accuracy_after"] >= summary["accuracy_before"] + 0.2, summary
    assert summary["frozen_linears"] == 30 * 7
    tags = json.loads((out / "adapter" / "pact_data.json").read_text())["labels"]
    assert summary["answer_after"] in tags, summary["answer_after"]  # one tag, then the end of sequence

    # `pact generate` on a held-out note prints a tag and stops, as a person runs it
    import subprocess
    import sys
    from pathlib import Path

    pact = str(Path(sys.executable).parent / "pact")
    note = "smoke alarm beeping, change the battery"
    proc = subprocess.run([pact, "generate", "--adapter", str(out / "adapter"), note], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.strip() in tags, (proc.stdout, proc.stderr[-2000:])

    # the adapter is plain PEFT: stock peft loads it on the unquantized base
    from peft import PeftModel
    from peft.tuners.lora import Linear as LoraLinear
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(summary["model"])
    model = PeftModel.from_pretrained(base, out / "adapter")
    assert sum(isinstance(m, LoraLinear) for m in model.modules()) == 30 * 7
    assert (out / "adapter" / "pact_config.json").is_file()


def test_soc_model_without_qnn_is_a_clear_error(capsys):
    assert main(["finetune", "--soc-model", "69"]) == 2
    assert "backend='torch' has no option soc_model='69'" in capsys.readouterr().err


def test_main_job_with_a_precision_plan(small_model, tmp_path, capsys):
    out = tmp_path / "run"
    args = ["finetune", "--model", str(small_model), "--output", str(out), "--max-steps", "3"]
    # no AQLoRA protection (the main job's default keeps a quarter 16-bit): the plan alone decides the fp16 layers
    assert main([*args, "--precision-budget-mib", "0.05", "--dtype", "float32", "--pact_protect_fraction", "0"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["products"] == {"torch": 3 * (14 + 11)} and 0 < summary["fp16_linears"] < 14
    plan = json.loads((out / "adapter" / "pact_config.json").read_text())["precision_plan"]
    assert sum(p == "fp16" for p in plan.values()) == summary["fp16_linears"] and len(plan) == 14
    assert "kept 16-bit" in capsys.readouterr().out


def test_main_job_keeps_the_quarter_nvfp4_reproduces_worst_16bit(small_model, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    from peft_ext.ranking import choose_protected

    out = tmp_path / "run"
    assert main(["finetune", "--model", str(small_model), "--output", str(out), "--max-steps", "1"]) == 0
    assert "ranked by gradient sensitivity" not in capsys.readouterr().err  # from the weights: no calibration pass
    pact = json.loads((out / "adapter" / "pact_config.json").read_text())
    assert pact["rank_by"] == "nvfp4" and pact["protect_fraction"] == 0.25
    worst = choose_protected(AutoModelForCausalLM.from_pretrained(small_model), 0.25, "nvfp4")
    assert len(worst) == 4 and pact["protected_modules"] == worst  # 14 linears: round(3.5) = 4
    assert json.loads((out / "summary.json").read_text())["fp16_linears"] == 4


@pytest.mark.skipif(not is_qnn_available(), reason="needs onnxruntime-qnn (optimum-pact[qnn])")
def test_main_job_on_qnn_runs_every_frozen_product_on_the_npu(small_model, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PACT_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "run"
    args = ["finetune", "--model", str(small_model), "--output", str(out), "--max-steps", "2", "--backend", "qnn"]
    assert main([*args, "--soc-model", "60"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["backend"] == "qnn" and summary["products"] == {"qnn": 2 * (14 + 11)}
    assert "all on qnn" in capsys.readouterr().out


def test_main_job_with_aqlora_speed(small_model, tmp_path):
    out = tmp_path / "run"
    args = ["finetune", "--model", str(small_model), "--output", str(out), "--max-steps", "3", "--dtype", "float32"]
    assert main([*args, "--protect-fraction", "0.2", "--adapt", "speed", "--adapt-top-blocks", "1"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["fp16_linears"] == 3 and summary["frozen_linears"] == 14
    pact = json.loads((out / "adapter" / "pact_config.json").read_text())
    assert pact["adapt"] == "speed" and len(pact["protected_modules"]) == 3
    assert json.loads((out / "adapter" / "adapter_config.json").read_text())["layers_to_transform"] == [1]


def test_main_job_ranks_aqlora_by_sensitivity_on_its_first_batch(small_model, tmp_path, capsys):
    out = tmp_path / "run"
    args = ["finetune", "--model", str(small_model), "--output", str(out), "--max-steps", "2", "--dtype", "float32"]
    assert main([*args, "--protect-fraction", "0.2", "--rank-by", "sensitivity"]) == 0
    assert "AQLoRA: 3 linears kept 16-bit, ranked by gradient sensitivity" in capsys.readouterr().err
    pact = json.loads((out / "adapter" / "pact_config.json").read_text())
    assert pact["rank_by"] == "sensitivity" and len(pact["protected_modules"]) == 3
    assert json.loads((out / "summary.json").read_text())["fp16_linears"] == 3


def test_bad_aqlora_option_is_a_clear_cli_error(capsys):
    assert main(["finetune", "--protect-fraction", "1.5"]) == 2
    assert "--protect-fraction: pact_protect_fraction=1.5 is outside the valid range [0, 1]" in capsys.readouterr().err


def test_main_job_with_memory_savers(small_model, tmp_path, capsys):
    out = tmp_path / "run"
    args = ["finetune", "--model", str(small_model), "--output", str(out), "--max-steps", "3", "--dtype", "float32"]
    assert main([*args, "--memory-saver", "full", "--subset-k", "64"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["memory_saver"] == "full" and summary["steps"] == 3
    assert summary["products"] == {"torch": 3 * (14 + 14 + 11)}  # + the recomputed forward of every linear
    printed = capsys.readouterr().out
    assert "(memory savers: full)" in printed
    assert not any((out / "trainer" / "pact-offload").iterdir())
    # streamed by default: resident peak (RSS) and the mapped weights' resident peak, apart
    mapped, resident = summary["mapped_gib"], summary["mapped_resident_peak_gib"]
    assert mapped > 0.01 and 0 < resident <= mapped and "of it resident (streamed)" in printed


def test_main_job_with_memory_savers_unstreamed(small_model, tmp_path, capsys):
    out = tmp_path / "run"
    args = ["finetune", "--model", str(small_model), "--output", str(out), "--max-steps", "2", "--dtype", "float32"]
    assert main([*args, "--memory-saver", "exact", "--pact_stream_weights", "false"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["mapped_gib"] > 0.01 and summary["mapped_resident_peak_gib"] is None
    assert "resident once touched (not streamed)" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--subset-k", "10"], "--subset-k: pact_subset_k=10 is used by pact_memory_saver='full' only"),
        (["--offload-dir", "/tmp/x"], "--offload-dir: pact_offload_dir='/tmp/x' is used by pact_memory_saver"),
        (["--memory-saver", "full", "--subset-k", "0"], "--subset-k: pact_subset_k=0 must be a positive integer"),
    ],
)
def test_bad_memory_saver_flags_are_clear_cli_errors(flags, message, capsys):
    assert main(["finetune", *flags]) == 2
    assert message in capsys.readouterr().err


# -- one parser over the dataclasses: every Trainer and PACT option, the old flags, a run file -----------------

OLD_FLAGS = {  # every flag of earlier releases -> (value given, option it sets, value expected)
    "--model": ("m", "model", "m"),
    "--data": ("d.jsonl", "data", "d.jsonl"),
    "--output": ("out", "output", "out"),
    "--backend": ("auto", "backend", "auto"),
    "--soc-model": ("69", "backend_options", {"soc_model": "69"}),
    "--precision-budget-mib": ("16", "precision_budget_mib", 16.0),
    "--r": ("4", "r", 4),
    "--lora-alpha": ("8", "lora_alpha", 8),
    "--learning-rate": ("0.01", "learning_rate", 0.01),
    "--epochs": ("3", "num_train_epochs", 3.0),
    "--max-steps": ("7", "max_steps", 7),
    "--batch-size": ("2", "per_device_train_batch_size", 2),
    "--dtype": ("float32", "dtype", "float32"),
    "--seed": ("5", "seed", 5),
    "--protect-fraction": ("0.2", "protect_fraction", 0.2),
    "--rank-by": ("nf4", "rank_by", "nf4"),
    "--adapt": ("speed", "adapt", "speed"),
    "--adapt-top-blocks": ("2", "adapt_top_blocks", 2),
    "--memory-saver": ("full", "pact_memory_saver", "full"),
    "--offload-dir": ("off", "pact_offload_dir", "off"),
    "--subset-k": ("64", "pact_subset_k", 64),
    "--save-steps": ("5", "save_steps", 5),
    "--save-minutes": ("3", "pact_save_minutes", 3.0),
    "--keep-checkpoints": ("4", "save_total_limit", 4),
    "--thermal-limit": ("41", "pact_thermal_limit_c", 41.0),
    "--duty-cycle": ("0.5", "pact_duty_cycle", 0.5),
    "--min-battery": ("30", "pact_min_battery", 30),
    "--sysfs-root": ("/fake", "pact_sysfs_root", "/fake"),
}


def _value(run, name):
    for part in (run.job, run.config, run.args):
        if hasattr(part, name):
            return getattr(part, name)
    raise AttributeError(name)


def test_every_old_flag_still_sets_its_option():
    argv = [token for flag, (value, _, _) in OLD_FLAGS.items() for token in (flag, value)]
    spelled = {}
    run = parse_finetune_args([*argv, "--background", "--only-while-charging"], spelled)
    for flag, (_, name, expected) in OLD_FLAGS.items():
        assert _value(run, name) == expected, (flag, name, _value(run, name))
        assert flag in spelled.values()
    assert run.job.background and run.args.pact_only_while_charging and run.args.pact_resumable


def test_defaults_are_the_main_job_and_background_fills_its_own():
    run = parse_finetune_args([])
    assert (run.config.r, run.config.lora_alpha, run.config.target_modules) == (8, 16, "all-linear")
    assert (run.args.learning_rate, run.args.num_train_epochs, run.args.per_device_train_batch_size) == (2e-3, 2, 8)
    assert run.args.seed == 0 and run.args.output_dir == "pact-output/trainer" and not run.args.pact_resumable
    run = parse_finetune_args(["--background", "--save-steps", "7"])
    assert (run.args.save_steps, run.args.save_total_limit, run.args.pact_save_minutes) == (7, 2, 10.0)
    assert run.args.pact_resumable and run.args.pact_thermal_pacing


def test_aliases_use_argparse_the_way_add_argument_does():
    # build_parser extends argparse's option tables (no public API for aliases): fail loudly if they change
    parser = build_parser()
    assert parser.parse_args(["--epochs", "3"]).num_train_epochs == 3
    assert "--epochs" in parser.format_help()


def test_run_file_sets_options_and_flags_override_it(tmp_path):
    run_file = tmp_path / "run.yaml"
    run_file.write_text("learning_rate: 0.01\nmax_steps: 3\npact_protect_fraction: 0.1\npact_memory_saver: exact\n")
    spelled = {}
    run = parse_finetune_args(["--config", str(run_file), "--max_steps", "5"], spelled)
    assert run.args.learning_rate == 0.01 and run.args.max_steps == 5 and run.config.protect_fraction == 0.1
    assert run.args.pact_memory_saver == "exact" and spelled["learning_rate"] == f"{run_file}: learning_rate"
    as_json = tmp_path / "run.json"
    as_json.write_text(json.dumps({"pact_backend": "auto", "r": 4}))
    run = parse_finetune_args(["--config", str(as_json)])
    assert run.config.backend == "auto" and run.config.r == 4


def test_main_job_from_a_run_file_with_any_trainer_option(small_model, tmp_path):
    out = tmp_path / "run"
    run_file = tmp_path / "run.yaml"
    run_file.write_text(
        f"model: {small_model}\noutput: {out}\nmax_steps: 2\ndtype: float32\nlr_scheduler_type: constant\n"
    )
    assert main(["finetune", "--config", str(run_file), "--per_device_train_batch_size", "4", "--max_steps", "3"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["products"] == {"torch": 3 * (14 + 11)}
    card = (out / "adapter" / "README.md").read_text()
    assert "| batch size | 4 |" in card and "| max steps | 3 |" in card


@pytest.mark.parametrize(
    ("argv", "run_file", "needles"),
    [
        (["--warmup_steps", "-1"], None, ["warmup_steps = -1"]),
        (["--min-battery", "150", "--background"], None, ["--min-battery: pact_min_battery=150"]),
        (
            ["--pact_backend_options", "{soc"],
            None,
            ["--pact_backend_options: pact_backend_options='{soc' is not valid"],
        ),
        ([], "lerning_rate: 0.1\n", ["run.yaml: 'lerning_rate' is not a pact finetune option", "learning_rate"]),
        ([], "pact_duty_cycle: 0\n", ["run.yaml: pact_duty_cycle: pact_duty_cycle=0 must be in (0, 1]"]),
        ([], "- a list\n", ["must hold a mapping"]),
    ],
)
def test_a_wrong_value_anywhere_is_one_clear_error_naming_it_as_written(argv, run_file, needles, tmp_path, capsys):
    if run_file is not None:
        (tmp_path / "run.yaml").write_text(run_file)
        argv = [*argv, "--config", str(tmp_path / "run.yaml")]
    assert main(["finetune", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pact finetune: error: ") and "Traceback" not in err
    for needle in needles:
        assert needle in err, (needle, err)


def test_a_malformed_flag_is_argparses_error_naming_the_flag_as_typed(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["finetune", "--epochs", "two"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--epochs" in err and "invalid float value: 'two'" in err and "Traceback" not in err


def test_no_option_is_declared_twice():
    # pact finetune parses these dataclasses; a name twice (or once with and once without the pact_ prefix) would be
    # one option declared in two places
    names = [f.name for cls in DATACLASSES for f in dataclasses.fields(cls)]
    assert len(names) == len(set(names))
    unprefixed = [name.removeprefix("pact_") for name in names]
    assert sorted({n for n in unprefixed if unprefixed.count(n) > 1}) == []
    # PactConfig's PACT fields are PactOptions' (+ what get_peft_model writes back) and PactTrainingArguments' are
    # the same fields prefixed: one declaration
    options = {f.name: f for f in dataclasses.fields(PactOptions)}
    config = {f.name: f for f in dataclasses.fields(PactConfig) if f.name in options}
    args = {
        f.name.removeprefix("pact_"): f
        for f in dataclasses.fields(PactTrainingArguments)
        if f.name.startswith("pact_")
    }
    for name, declared in options.items():
        for copy in (config[name], args[name]):
            assert (copy.default, copy.metadata["help"]) == (declared.default, declared.metadata["help"])
