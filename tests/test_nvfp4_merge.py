"""`pact export --format nvfp4-merged`: the adapter merged into the NVFP4 base, re-quantized, reloaded and scored."""

import json

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from optimum_pact.commands.calibration import calibration_rows
from optimum_pact.commands.modeling import PactModelForCausalLM, read_adapter_config
from optimum_pact.commands.nvfp4_merge import export_nvfp4_merged, merged_weights
from optimum_pact.dataflow import FrozenLinear
from optimum_pact.errors import OptionError
from optimum_pact.nvfp4 import NVFP4Tensor
from optimum_pact.precision import resolve_dtype

PROMPT = torch.tensor([[1, 520, 1742, 314, 2283, 30]])


def _adapter(base_folder, out, size):
    """A LoRA adapter whose weight change is about `size` times the weights' own spread."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(base_folder, dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=4, target_modules="all-linear", init_lora_weights=False))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_A" in name:
                p.copy_(torch.randn_like(p) / p.shape[1] ** 0.25)
            if "lora_B" in name:
                p.copy_(torch.randn_like(p) * size * 0.02 / p.shape[1] ** 0.25)  # the base's init std is 0.02
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def small_delta(small_model, tmp_path_factory):
    return _adapter(small_model, tmp_path_factory.mktemp("adapter") / "a", 0.05)


def test_rounding_the_original_weights_keeps_a_small_change_that_requantizing_loses(small_model, small_delta):
    pact = PactModelForCausalLM.from_pretrained(str(small_model), adapter=str(small_delta), dtype="float32")
    _, from_nvfp4 = merged_weights(pact, "nvfp4", 0.0)
    _, from_original = merged_weights(pact, "original", 0.0)
    # a change 1/20 of the weights' spread is far below the grid step: requantizing puts the weights back
    assert from_nvfp4 < 0.1 and from_original > 0.5, (from_nvfp4, from_original)
    weights, all_kept = merged_weights(pact, "nvfp4", 1.0)
    assert all(w.dtype == torch.bfloat16 for w in weights.values()) and all_kept == pytest.approx(1.0, abs=0.02)
    weights, _ = merged_weights(pact, "original", 0.25)
    assert sum(not isinstance(w, NVFP4Tensor) for w in weights.values()) == round(0.25 * 14)


def test_the_size_budget_keeps_the_linears_rounded_worst_and_holds_the_size(small_model, small_delta):
    pact = PactModelForCausalLM.from_pretrained(str(small_model), adapter=str(small_delta), dtype="float32")
    layers = {n: m for n, m in pact.model.named_modules() if hasattr(m, "get_delta_weight")}
    numel = {n.removeprefix("base_model.model."): m.in_features * m.out_features for n, m in layers.items()}
    rest = sum(p.numel() for n, p in pact.model.named_parameters() if "lora_" not in n) * 2  # embeddings, norms
    all_nvfp4 = rest + sum(numel.values()) * 0.5625  # 4 bits and one e4m3 scale per 16 weights

    def merged(budget):
        weights, _ = merged_weights(pact, "nvfp4", 0.0, rounding="gptq", size_budget=budget)
        kept = [n for n, w in weights.items() if not isinstance(w, NVFP4Tensor)]
        size = rest + sum(numel[n] * (2 if n in kept else 0.5625) for n in numel)
        return weights, kept, size

    none, kept_none, _ = merged(1.0)
    budget = 1 + 0.3 * sum(numel.values()) * (2 - 0.5625) / all_nvfp4  # room for about a third of the linears
    weights, kept, size = merged(budget)
    assert not kept_none and 0 < len(kept) < len(numel) and size <= budget * all_nvfp4
    assert all(size + numel[n] * (2 - 0.5625) > budget * all_nvfp4 for n in numel if n not in kept)  # none more fits

    inputs = {}  # each linear's inputs on the training items, taken here from the running model
    hooks = [m.register_forward_pre_hook(lambda mod, args, n=n: inputs.setdefault(n, []).append(args[0].flatten(0, 1)))
             for n, m in layers.items()]  # fmt: skip
    with torch.no_grad():
        for ids in calibration_rows(pact.tokenizer, None):
            pact.model(torch.tensor([ids]))
    for hook in hooks:
        hook.remove()
    exact, _ = merged_weights(pact, "nvfp4", 1.0)  # every linear bf16: deq(Q(W)) + delta
    moved = {}  # how far each linear's NVFP4 rounding moves its outputs
    for name, xs in inputs.items():
        short = name.removeprefix("base_model.model.")
        x = torch.cat(xs).float()
        moved[short] = float((x @ (none[short].dequantize(torch.float32) - exact[short].float()).T).pow(2).sum())
    worst = sorted(moved, key=moved.get, reverse=True)
    assert worst[0] in kept  # the linear rounded worst is kept, and the kept ones moved more than others would
    assert sum(moved[n] for n in kept) > sum(moved[n] for n in worst[len(worst) - len(kept) :])


def test_the_merged_folder_reloads_as_reported_and_computes_the_merge(small_model, small_delta, tmp_path):
    out = tmp_path / "merged"
    report = export_nvfp4_merged(
        small_delta, out, str(small_model), requantize_from="nvfp4", keep_16bit=0.5, size_budget=1.0
    )
    saved = json.loads((out / "merge_report.json").read_text())
    assert saved["kept_16bit"] == report.kept_16bit and len(report.kept_16bit) == 7 and saved["metric"] == "accuracy"
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    frozen = {n for n, m in reloaded.named_modules() if isinstance(m, FrozenLinear)}
    assert len(frozen) == 7 and not frozen & set(report.kept_16bit)  # the kept ones load as plain bf16 linears
    pact = PactModelForCausalLM.from_pretrained(str(small_model), adapter=str(small_delta))  # as the export loads it
    weights, _ = merged_weights(pact, "nvfp4", 0.5, rounding="gptq")  # the export's default rounding
    for name, weight in weights.items():
        module = reloaded.get_submodule(name)
        got = module.dequantize(torch.float32) if name in frozen else module.weight.float()
        want = weight.dequantize(torch.float32) if isinstance(weight, NVFP4Tensor) else weight.float()
        torch.testing.assert_close(got, want, atol=0, rtol=0)  # exactly the merge that was scored
    assert (out / "tokenizer.json").is_file() and not list(tmp_path.glob(".merged-partial-*"))


def test_bad_merge_options_are_named_and_nothing_is_written(small_model, small_delta, tmp_path):
    with pytest.raises(OptionError, match="keep_16bit.*from 0 to 1"):
        export_nvfp4_merged(small_delta, tmp_path / "m", str(small_model), keep_16bit=2.0)
    with pytest.raises(OptionError, match="requantize_from.*'exact' is not one of nvfp4, original"):
        export_nvfp4_merged(small_delta, tmp_path / "m", str(small_model), requantize_from="exact")
    assert not list(tmp_path.iterdir())


def test_rounding_from_the_original_on_a_packed_checkpoint_is_refused_by_name(small_model, small_delta, tmp_path):
    from transformers import AutoTokenizer as Tokenizer

    from optimum_pact.quantizer import PactQuantizationConfig

    packed = tmp_path / "packed"  # a base saved as NVFP4: its linears hold codes, not full-precision weights
    AutoModelForCausalLM.from_pretrained(small_model, quantization_config=PactQuantizationConfig()).save_pretrained(
        packed
    )
    Tokenizer.from_pretrained(small_model).save_pretrained(packed)
    pact = PactModelForCausalLM.from_pretrained(str(packed), adapter=str(small_delta))
    with pytest.raises(OptionError, match=r"'original' needs the base's full-precision weights.*packed \(NVFP4\)"):
        merged_weights(pact, "original", 0.0)
    weights, _ = merged_weights(pact, "nvfp4", 0.0)  # the usual merge needs only the packed base
    assert all(isinstance(w, NVFP4Tensor) for w in weights.values())


@pytest.mark.slow
def test_the_main_jobs_adapter_merged_keeps_its_gain_and_the_folder_scores_as_reported(
    main_job, main_job_merged, tmp_path
):
    from optimum_pact.commands.evaluation import accuracy, classify
    from optimum_pact.commands.finetune import load_data

    out, _ = main_job
    folder, kept, warnings = main_job_merged  # the default merge: GPTQ of the trained weights
    usual = export_nvfp4_merged(out / "adapter", tmp_path / "usual", requantize_from="nvfp4", rounding="nearest")
    assert kept.adapter >= kept.base + 0.2 and kept.gain_kept >= 0.9 and not any("gain" in w for w in warnings)
    assert kept.gain_kept >= usual.gain_kept
    trained = set(read_adapter_config(out / "adapter").sixteen_bit_modules())
    assert len(trained) == 53 and trained < set(kept.kept_16bit)  # the 16-bit quarter, merged exactly, and the
    assert len(kept.kept_16bit) <= 53 + 20  # few the size budget keeps

    # as a user loads it (NVFP4, ModelOpt layout), in the dtype the export scored it in
    reloaded = AutoModelForCausalLM.from_pretrained(folder, dtype=resolve_dtype("auto"))
    assert sum(isinstance(m, FrozenLinear) for m in reloaded.modules()) == 30 * 7 - len(kept.kept_16bit)
    _, train, heldout = load_data(None)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    labels = sorted({item["label"] for item in train + heldout})
    guesses = classify(reloaded, tokenizer, [item["text"] for item in heldout], labels)
    assert accuracy(guesses, [item["label"] for item in heldout]) == pytest.approx(kept.merged, abs=1e-9)


def test_pact_export_nvfp4_merged_prints_the_report_and_names_a_bad_option(small_model, small_delta, tmp_path, capsys):
    from optimum_pact.commands.cli import main

    base = ["export", "--model", str(small_model), "--adapter", str(small_delta), "--format", "nvfp4-merged"]
    assert main([*base, "--output", str(tmp_path / "bad"), "--keep_16bit", "1.5"]) == 2
    assert "keep_16bit=1.5 is not a fraction" in capsys.readouterr().err and not (tmp_path / "bad").exists()
    assert main([*base, "--output", str(tmp_path / "ok"), "--requantize_from", "nvfp4"]) == 0
    printed = capsys.readouterr().out
    assert (
        "held-out accuracy: base" in printed
        and "merged" in printed
        and (tmp_path / "ok" / "merge_report.json").is_file()
    )
