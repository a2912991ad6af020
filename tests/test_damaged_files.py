"""Damaged files on disk: a model folder that is not a causal LM, damaged adapter and checkpoint files, and what
`pact generate`, `pact chat` and `pact export` make of a missing or damaged adapter or model folder.

Every case ends in one message naming the file and what to do (one `pact COMMAND: error:` line from the CLI, no
traceback), or, for a resumable checkpoint, in the damaged checkpoint being reported and skipped.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from conftest import tiny_model
from datasets import Dataset
from peft import LoraConfig, get_peft_model
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import BertConfig, BertForMaskedLM, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, T5Config

from optimum_pact.commands.cli import main
from peft_ext import PACT_CONFIG_NAME, PactConfig
from trainer_callbacks import CorruptCheckpointError, PactTrainer, PactTrainingArguments
from trainer_callbacks.checkpoint import MANIFEST_NAME, list_checkpoints

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
NOTES = [("buy milk and eggs", "errand"), ("call the plumber", "errand"), ("pick up the parcel", "errand"),
         ("renew passport", "errand"), ("idea: a bike light app", "idea"), ("idea: garden sensor", "idea"),
         ("idea: recipe planner", "idea"), ("idea: sleep tracker", "idea")]  # fmt: skip


def _byte_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab["<eos>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<eos>")


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """A tiny Llama folder with a byte-level tokenizer (offline, seconds), a data file and the CLI arguments."""
    root = tmp_path_factory.mktemp("job")
    model = root / "model"
    tokenizer = _byte_tokenizer()
    tokenizer.save_pretrained(model)
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), **TINY)).save_pretrained(model)
    data = root / "notes.jsonl"
    data.write_text("".join(json.dumps({"text": t, "label": label}) + "\n" for t, label in NOTES))
    (root / "sys").mkdir()  # a sensorless sysfs: pacing warns and runs on
    args = ["finetune", "--data", str(data), "--dtype", "float32", "--batch-size", "2", "--epochs", "10",
            "--learning-rate", "0.01", "--sysfs-root", str(root / "sys")]  # fmt: skip
    return root, model, args


def _cli_error(capsys) -> str:
    """The CLI's stderr, checked to be one `pact finetune: error:` line and no traceback; returns that line."""
    err = capsys.readouterr().err
    assert "Traceback" not in err, err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith("pact finetune: error: ")]
    assert len(lines) == 1, err[-3000:]
    return lines[0]


# ---- 3. a model folder whose config.json is empty or not a causal LM ----


def _t5_config() -> str:
    config = T5Config(d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=2, vocab_size=300).to_dict()
    return json.dumps({**config, "architectures": ["T5ForConditionalGeneration"]})


@pytest.mark.parametrize(
    "config_json, needles",
    [
        ("", ["config.json is empty", "copy the model folder again"]),
        ('{"model_type": "llama", "hidden_size": ', ["config.json is not valid JSON", "line 1 column"]),
        ('["llama"]', ["config.json does not hold a JSON object"]),
        ('{"hidden_size": 64}', ["config.json has no model_type"]),
        ('{"model_type": "no-such-model"}', ["model_type 'no-such-model'", "does not know", "upgrade transformers"]),
        (_t5_config(), ["model_type 't5'", "AutoModelForCausalLM cannot load", "not a causal language model"]),
    ],
    ids=["empty", "truncated", "not-an-object", "no-model-type", "unknown-model-type", "t5"],
)
def test_model_folder_with_a_bad_config_is_one_clear_error(job, tmp_path, capsys, config_json, needles):
    root, model, args = job
    folder = shutil.copytree(model, tmp_path / "model")
    (folder / "config.json").write_text(config_json)
    assert main([*args, "--model", str(folder), "--output", str(tmp_path / "out")]) == 2
    line = _cli_error(capsys)
    assert line.startswith(f"pact finetune: error: --model {str(folder)!r}: {folder / 'config.json'}"), line
    assert all(needle in line for needle in needles), line
    assert "leave out --model" in line and "sentencepiece" not in line
    assert not (tmp_path / "out" / "summary.json").exists()


def test_masked_lm_folder_is_refused_before_training(job, tmp_path, capsys):
    """BERT: AutoModelForCausalLM would load BertForMaskedLM weights as a BertLMHeadModel (bidirectional)."""
    root, model, args = job
    folder = tmp_path / "bert"
    tokenizer = _byte_tokenizer()
    tokenizer.save_pretrained(folder)
    config = BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=64)  # fmt: skip
    BertForMaskedLM(config).save_pretrained(folder)
    assert main([*args, "--model", str(folder), "--output", str(tmp_path / "out"), "--max-steps", "1"]) == 2
    line = _cli_error(capsys)
    assert f"{folder / 'config.json'} describes a BertForMaskedLM" in line, line
    assert "masked language model" in line and "not a causal language model" in line and "leave out --model" in line


def test_model_folder_without_tokenizer_files_says_so(job, tmp_path, capsys):
    root, model, args = job
    folder = tmp_path / "model"
    folder.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(model / name, folder / name)
    assert main([*args, "--model", str(folder), "--output", str(tmp_path / "out")]) == 2
    line = _cli_error(capsys)
    assert f"--model {str(folder)!r}: the tokenizer in {folder} could not be loaded" in line, line
    assert "tokenizer.save_pretrained" in line


# ---- 4a. adapter folders: PactConfig.from_pretrained ----


@pytest.fixture(scope="module")
def adapter(tmp_path_factory) -> Path:
    """A PACT adapter folder with a non-default PACT setting (so that losing pact_config.json changes the model)."""
    folder = tmp_path_factory.mktemp("adapter")
    config = PactConfig(r=4, target_modules="all-linear", backend_options={"tile_size": 32})
    get_peft_model(tiny_model(), config).save_pretrained(folder)
    return folder


def _copy(folder: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(folder, tmp_path / folder.name))


@pytest.mark.parametrize(
    "name, text, needle",
    [
        ("adapter_config.json", "", "is empty"),
        ("adapter_config.json", '{"r": 4, "lora_alpha"', "is not valid JSON (Expecting"),
        ("adapter_config.json", "[4]", "does not hold a JSON object"),
        (PACT_CONFIG_NAME, "", "is empty"),
        (PACT_CONFIG_NAME, '{"backend": "torch", ', "is not valid JSON (Expecting"),
        (PACT_CONFIG_NAME, '["torch"]', "does not hold a JSON object"),
    ],
    ids=["adapter-empty", "adapter-truncated", "adapter-list", "pact-empty", "pact-truncated", "pact-list"],
)
def test_damaged_adapter_config_files_are_named(adapter, tmp_path, name, text, needle):
    folder = _copy(adapter, tmp_path)
    (folder / name).write_text(text)
    with pytest.raises(ValueError) as info:
        PactConfig.from_pretrained(str(folder))
    message = str(info.value)
    assert message.startswith(f"{folder / name} {needle}"), message
    assert "copy the adapter folder again" in message and "save_pretrained" in message


def test_bad_value_in_pact_config_json_names_the_file(adapter, tmp_path):
    folder = _copy(adapter, tmp_path)
    (folder / PACT_CONFIG_NAME).write_text(
        json.dumps({**json.loads((folder / PACT_CONFIG_NAME).read_text()), "adapt": 5})
    )
    with pytest.raises(ValueError, match=r"pact_config.json: adapt=5 must be one of 'quality', 'speed'"):
        PactConfig.from_pretrained(str(folder))


def test_missing_pact_config_json_is_an_error_unless_allowed(adapter, tmp_path):
    folder = _copy(adapter, tmp_path)
    assert PactConfig.from_pretrained(str(folder)).backend_options == {"tile_size": 32}
    (folder / PACT_CONFIG_NAME).unlink()
    with pytest.raises(FileNotFoundError) as info:
        PactConfig.from_pretrained(str(folder))
    message = str(info.value)
    assert f"{folder} has adapter_config.json but no {PACT_CONFIG_NAME}" in message, message
    assert (
        "Copy pact_config.json from the folder the adapter was saved to" in message
        and "allow_missing_sidecar=True" in message
    )
    plain = PactConfig.from_pretrained(str(folder), allow_missing_sidecar=True)  # a plain peft LoRA adapter
    assert plain.backend_options is None and plain.r == 4


def test_adapter_on_the_hub_reads_its_pact_config_json(adapter, monkeypatch):
    """A Hub id: both files come through hf_hub_download (stubbed to the local folder here)."""
    import huggingface_hub
    import peft.config

    def download(repo_id, filename, subfolder=None, **kwargs):
        assert repo_id == "someone/pact-adapter"
        path = adapter / (subfolder or "") / filename
        if not path.is_file():
            raise huggingface_hub.errors.EntryNotFoundError(f"{filename} not in {repo_id}")
        return str(path)

    monkeypatch.setattr(peft.config, "hf_hub_download", download)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    assert PactConfig.from_pretrained("someone/pact-adapter").backend_options == {"tile_size": 32}


# ---- 4b. resumable checkpoints: PactTrainer.train(resume_from_checkpoint=...) ----


def _data() -> Dataset:
    ids = torch.randint(0, 128, (8, 16), generator=torch.Generator().manual_seed(1))
    return Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})


def _trainer(out: Path) -> PactTrainer:
    args = PactTrainingArguments(
        output_dir=str(out), report_to="none", use_cpu=True, disable_tqdm=True, max_steps=4,
        per_device_train_batch_size=4, learning_rate=1e-2, seed=0, save_strategy="steps", save_steps=2,
        pact_resumable=True, pact_report_resources=False,
    )  # fmt: skip
    model = get_peft_model(tiny_model(), PactConfig(r=4, target_modules="all-linear"))
    return PactTrainer(model=model, args=args, train_dataset=_data())


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """An output folder with one committed checkpoint (step 2) of a run stopped there."""
    out = tmp_path_factory.mktemp("trained")
    trainer = _trainer(out)
    trainer.args.max_steps = 2
    trainer.train()
    assert [c.name for c in list_checkpoints(out / "checkpoints")] == ["checkpoint-2"]
    return out


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _seal(checkpoint: Path, name: str) -> None:
    """Record `name`'s current bytes in the manifest: damage that happened before the checkpoint was sealed."""
    manifest = json.loads((checkpoint / MANIFEST_NAME).read_text())
    data = (checkpoint / name).read_bytes()
    manifest["files"][name] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    (checkpoint / MANIFEST_NAME).write_text(json.dumps(manifest))


def test_flipped_byte_in_a_given_checkpoint_says_which_file_and_what_to_do(trained, tmp_path):
    out = _copy(trained, tmp_path)
    checkpoint = out / "checkpoints" / "checkpoint-2"
    _flip_byte(checkpoint / "adapter_model.safetensors")
    with pytest.raises(CorruptCheckpointError) as info:
        _trainer(out).train(resume_from_checkpoint=str(checkpoint))
    message = str(info.value)
    assert f"{checkpoint}: adapter_model.safetensors does not match its sha256" in message, message
    assert "find_checkpoint()" in message and "resume_from_checkpoint=None" in message


@pytest.mark.parametrize(
    "name, damage, needle",
    [
        ("adapter_model.safetensors", _truncate, "adapter_model.safetensors is damaged (incomplete metadata"),
        ("trainer_state.json", _truncate, "trainer_state.json is damaged (not valid JSON"),
        ("optimizer.pt", _flip_byte, "optimizer.pt is damaged"),
    ],
    ids=["truncated-adapter", "truncated-state", "flipped-optimizer"],
)
def test_damaged_file_in_a_checkpoint_without_manifest_is_named(trained, tmp_path, name, damage, needle):
    """A plain Trainer checkpoint (no pact_checkpoint.json) is resumed unverified; its files must still be readable."""
    out = _copy(trained, tmp_path)
    checkpoint = out / "checkpoints" / "checkpoint-2"
    (checkpoint / MANIFEST_NAME).unlink()
    damage(checkpoint / name)
    with pytest.raises(CorruptCheckpointError) as info:
        _trainer(out).train(resume_from_checkpoint=str(checkpoint))
    message = str(info.value)
    assert message.startswith(f"{checkpoint}: {needle}"), message
    assert "resume_from_checkpoint=None" in message


def test_missing_checkpoint_folder_is_named(trained, tmp_path):
    with pytest.raises(FileNotFoundError, match="resume_from_checkpoint='.*checkpoint-7' does not exist"):
        _trainer(tmp_path).train(resume_from_checkpoint=str(tmp_path / "checkpoints" / "checkpoint-7"))


# ---- 4c. resumable checkpoints: `pact finetune --background` run again ----


@pytest.fixture(scope="module")
def background(job, tmp_path_factory):
    """A --background run stopped after its first checkpoint (step 3): its only checkpoint."""
    root, model, args = job
    out = tmp_path_factory.mktemp("background") / "out"
    cli = [*args, "--model", str(model), "--background", "--save-steps", "3", "--output", str(out)]
    assert main([*cli, "--max-steps", "3"]) == 0
    assert [c.name for c in list_checkpoints(out / "trainer" / "checkpoints")] == ["checkpoint-3"]
    return cli, out


def _manifest_entry_not_an_object(checkpoint: Path) -> None:
    manifest = json.loads((checkpoint / MANIFEST_NAME).read_text())
    manifest["files"]["trainer_state.json"] = "sha256:0"
    (checkpoint / MANIFEST_NAME).write_text(json.dumps(manifest))


def _manifest_identity_not_an_object(checkpoint: Path) -> None:
    manifest = json.loads((checkpoint / MANIFEST_NAME).read_text())
    (checkpoint / MANIFEST_NAME).write_text(json.dumps({**manifest, "identity": "llama"}))


def _manifest_path_outside(checkpoint: Path) -> None:
    manifest = json.loads((checkpoint / MANIFEST_NAME).read_text())
    manifest["files"]["../../summary.json"] = {"sha256": "0" * 64, "bytes": 1}
    (checkpoint / MANIFEST_NAME).write_text(json.dumps(manifest))


def _sealed(name: str, damage):
    def apply(checkpoint: Path) -> None:
        damage(checkpoint / name)
        _seal(checkpoint, name)

    return apply


@pytest.mark.parametrize(
    "damage, reason",
    [
        (_manifest_entry_not_an_object, f"{MANIFEST_NAME} lists trainer_state.json without its size and sha256"),
        (_manifest_identity_not_an_object, f"{MANIFEST_NAME} has no valid identity"),
        (_manifest_path_outside, f"{MANIFEST_NAME} lists '../../summary.json', outside the checkpoint"),
        (_sealed("adapter_model.safetensors", _truncate), "adapter_model.safetensors is damaged (incomplete metadata"),
        (_sealed("trainer_state.json", _truncate), "trainer_state.json is damaged (not valid JSON"),
        (_sealed("optimizer.pt", _truncate), "optimizer.pt is damaged"),
    ],
    ids=["manifest-entry", "manifest-identity", "manifest-path", "sealed-adapter", "sealed-state", "sealed-optimizer"],
)
def test_damaged_only_checkpoint_is_reported_and_the_run_starts_over(
    background, tmp_path, capsys, caplog, damage, reason
):
    cli, trained_out = background
    out = shutil.copytree(trained_out, tmp_path / "out")
    checkpoints = out / "trainer" / "checkpoints"
    damage(checkpoints / "checkpoint-3")
    i = cli.index("--output")
    with caplog.at_level(logging.WARNING):
        rc = main([*cli[:i], "--output", str(out), "--max-steps", "4"])
    err = capsys.readouterr().err
    assert "Traceback" not in err and rc == 0, err[-3000:] + caplog.text[-3000:]
    assert f"corrupt checkpoint skipped: {checkpoints / 'checkpoint-3'}: {reason}" in caplog.text, caplog.text
    assert "no valid checkpoint is left" in caplog.text and "starts from step 0" in caplog.text
    assert (checkpoints / "checkpoint-3.corrupt").is_dir()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["background"]["resumed_from_step"] == 0 and summary["steps"] == 4


# ---- 5. pact generate, chat and export: a missing or damaged adapter or model folder ----


@pytest.fixture(scope="module")
def to_use(job, tmp_path_factory):
    """The job's model, a plain LoRA adapter for it, and one for a Qwen2 of other shapes (no base recorded)."""
    root, model, _ = job
    folder = tmp_path_factory.mktemp("to_use")
    for base, name in ((LlamaForCausalLM.from_pretrained(model), "adapter"),
                       (tiny_model("qwen2", hidden_size=32, intermediate_size=64), "qwen2-adapter")):  # fmt: skip
        config = LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False)
        get_peft_model(base, config).save_pretrained(folder / name)
    return model, folder / "adapter", folder / "qwen2-adapter"


USES = {
    "generate": lambda out: ["generate", "--dtype", "float32", "--max_new_tokens", "2", "hi"],
    "chat": lambda out: ["chat", "--dtype", "float32"],
    "merged-bf16": lambda out: ["export", "--format", "merged-bf16", "--output", str(out / "merged")],
    "gguf-lora": lambda out: ["export", "--format", "gguf-lora", "--output", str(out / "adapter.gguf")],
    "nvfp4-merged": lambda out: ["export", "--format", "nvfp4-merged", "--output", str(out / "nvfp4")],
}


def _no_adapter(model, adapter, other, tmp_path):
    gone = tmp_path / "gone"
    return model, gone, [f"--adapter {str(gone)!r} does not exist", "pass the adapter folder of a run"]


def _truncated_adapter(model, adapter, other, tmp_path):
    adapter = _copy(adapter, tmp_path)
    _truncate(adapter / "adapter_model.safetensors")
    weights = adapter / "adapter_model.safetensors"
    return model, adapter, [f"{weights} is damaged (incomplete metadata", "copy the adapter folder again"]


def _adapter_config_not_json(model, adapter, other, tmp_path):
    adapter = _copy(adapter, tmp_path)
    (adapter / "adapter_config.json").write_text('{"peft_type": "LORA", "r": ')
    return model, adapter, [f"{adapter / 'adapter_config.json'} is not valid JSON", "copy the adapter folder again"]


def _adapter_of_another_model(model, adapter, other, tmp_path):
    return model, other, [str(other), "fit", "pass --model"]


def _no_model(model, adapter, other, tmp_path):
    gone = tmp_path / "no-model"
    return gone, adapter, [f"--model {str(gone)!r} does not exist", "pass an existing model folder"]


def _model_config_cut(model, adapter, other, tmp_path):
    model = _copy(model, tmp_path)
    _truncate(model / "config.json")
    return model, adapter, [f"{model / 'config.json'} is not valid JSON", "copy the model folder again"]


def _model_weights_cut(model, adapter, other, tmp_path):
    model = _copy(model, tmp_path)
    _truncate(model / "model.safetensors")
    return model, adapter, [f"the weights in {model} could not be loaded (", "copy the model folder again"]


DAMAGES = [_no_adapter, _truncated_adapter, _adapter_config_not_json, _adapter_of_another_model, _no_model,
           _model_config_cut, _model_weights_cut]  # fmt: skip


CASES = [
    pytest.param(use, damage, id=f"{use}-{damage.__name__.strip('_').replace('_', '-')}")
    for use in USES
    for damage in DAMAGES
    if not (use == "gguf-lora" and damage is _model_weights_cut)  # it reads the base's config.json, not its weights
]


@pytest.mark.parametrize("use, damage", CASES)
def test_generate_chat_and_export_say_in_one_line_which_folder_is_damaged(to_use, tmp_path, capsys, use, damage):
    model, adapter, needles = damage(*to_use, tmp_path)
    argv = USES[use](tmp_path / "out")
    capsys.readouterr()
    assert main([argv[0], "--model", str(model), "--adapter", str(adapter), *argv[1:]]) == 2
    err = capsys.readouterr().err
    command = argv[0]
    assert "Traceback" not in err, err[-3000:]
    lines = [line for line in err.splitlines() if "error" in line.lower()]
    assert len(lines) == 1 and lines[0].startswith(f"pact {command}: error: "), err[-3000:]
    assert err.rstrip().splitlines()[-1] == lines[0], err[-3000:]  # nothing after it: one line says it all
    assert all(needle in lines[0] for needle in needles), lines[0]
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())  # nothing half-written
