"""PactModelForCausalLM, `pact generate` and `pact chat`: a trained adapter used on the same NVFP4 base."""

import json
import shutil

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

from optimum_pact.backends.qnn import is_qnn_available
from optimum_pact.commands.cli import main
from optimum_pact.commands.export import export_merged
from optimum_pact.commands.generation import parse, run_chat
from optimum_pact.commands.modeling import PactModelForCausalLM
from optimum_pact.dataflow import FrozenLinear

PROMPT = torch.tensor([[1, 520, 1742, 314, 2283, 30]])


def _adapter(base_folder, out, seed):
    """A LoRA adapter with random (non-zero) B, saved as plain PEFT files."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base_folder, dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(20)  # strong enough to change greedy tokens
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def adapters(small_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return _adapter(small_model, root / "a", 1), _adapter(small_model, root / "b", 2)


def _tokens(model, **kw):
    out = model.generate(input_ids=PROMPT, max_new_tokens=32, do_sample=False, min_new_tokens=32, **kw)
    return out[0, PROMPT.shape[1] :].tolist()


def test_generate_equals_stock_peft_on_the_dequantized_base_token_for_token(small_model, adapters):
    pact = PactModelForCausalLM.from_pretrained(str(small_model), adapter=str(adapters[0]), dtype="float32")
    reference = AutoModelForCausalLM.from_pretrained(small_model, dtype=torch.float32)
    frozen = {n: m for n, m in pact.model.get_base_model().named_modules() if isinstance(m, FrozenLinear)}
    assert len(frozen) == 14
    with torch.no_grad():
        for name, layer in frozen.items():
            target = reference.get_submodule(name.removesuffix(".base_layer"))
            target.weight.copy_(layer.dequantize(torch.float32))  # the same effective weights
    reference = PeftModel.from_pretrained(reference, adapters[0]).eval()
    pad = pact.tokenizer.eos_token_id
    assert _tokens(pact) == _tokens(reference, pad_token_id=pad)
    assert pact.backend.counts["forward"] >= 32 * 14  # every decode step ran the frozen products on the backend


def test_adapter_swap_changes_the_output_and_back_with_the_base_untouched(small_model, adapters):
    pact = PactModelForCausalLM.from_pretrained(str(small_model), adapter={"a": str(adapters[0])}, dtype="float32")
    base = {n: (b.data_ptr(), b.clone()) for n, b in pact.model.get_base_model().named_buffers()}
    first = _tokens(pact)
    pact.load_adapter(adapters[1], "b")
    pact.set_adapter("b")
    second = _tokens(pact)
    pact.set_adapter("a")
    assert first != second and _tokens(pact) == first and pact.adapters == ["a", "b"]
    for name, buffer in pact.model.get_base_model().named_buffers():
        pointer, before = base[name]
        assert buffer.data_ptr() == pointer and torch.equal(buffer, before), name  # not copied, not changed
    with pytest.raises(ValueError, match="an adapter named 'b' is loaded already"):
        pact.load_adapter(adapters[1], "b")
    with pytest.raises(ValueError, match="no adapter named 'c'; loaded: \\['a', 'b'\\]"):
        pact.set_adapter("c")


@pytest.mark.skipif(not is_qnn_available(), reason="needs onnxruntime-qnn (optimum-pact[qnn])")
def test_generate_on_qnn_runs_every_product_on_the_npu_within_fp16_tolerance(
    small_model, adapters, monkeypatch, tmp_path
):
    monkeypatch.setenv("PACT_CACHE", str(tmp_path))
    torch_model = PactModelForCausalLM.from_pretrained(str(small_model), adapter=str(adapters[0]), dtype="float32")
    qnn = PactModelForCausalLM.from_pretrained(
        str(small_model), adapter=str(adapters[0]), backend="qnn", dtype="float32"
    )
    assert {type(m.backend).__name__ for m in qnn.model.modules() if isinstance(m, FrozenLinear)} == {"QnnBackend"}
    with torch.no_grad():
        expected, got = torch_model.model(input_ids=PROMPT).logits, qnn.model(input_ids=PROMPT).logits
    torch.testing.assert_close(got, expected, atol=2e-2 * expected.abs().max().item(), rtol=0)
    out = qnn.generate(input_ids=PROMPT, max_new_tokens=4, do_sample=False)
    assert out.shape[1] == PROMPT.shape[1] + 4 and qnn.backend.counts["forward"] >= 5 * 14


def test_pact_generate_streams_and_pact_chat_keeps_the_conversation(small_model, adapters, capsys):
    argv = ["--model", str(small_model), "--adapter", f"a={adapters[0]}", "--adapter", f"b={adapters[1]}"]
    assert main(["generate", *argv, "--use", "b", "--max_new_tokens", "5", "--dtype", "float32", "hello"]) == 0
    assert capsys.readouterr().out.strip()
    args, _ = parse([*argv, "--max_new_tokens", "3", "--dtype", "float32"], "chat")
    messages = run_chat(args, lines=["hi", "/reset", "again", "/quit", "never read"])
    assert [m["role"] for m in messages] == ["user", "assistant"] and messages[0]["content"] == "again"
    assert "(conversation reset)" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--use", "nobody"], "no adapter named 'nobody'; loaded: ['a']"),
        (["--max_new_tokens", "100000"], "exceeds the model's"),
    ],
)
def test_generation_errors_are_one_clear_line(small_model, adapters, argv, needle, capsys):
    base = ["generate", "--model", str(small_model), "--adapter", f"a={adapters[0]}", "--dtype", "float32"]
    assert main([*base, *argv, "hi"]) == 2
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]  # after transformers' loading bar
    assert last.startswith("pact generate: error: ") and needle in last and "Traceback" not in err


def test_an_adapter_folder_without_weights_or_from_another_base_is_refused(small_model, adapters, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="holds no adapter weights"):
        PactModelForCausalLM.from_pretrained(str(small_model), adapter=str(empty), dtype="float32")
    other_base = tmp_path / "other"
    other_base.mkdir()
    config = json.loads((small_model / "config.json").read_text())
    (other_base / "config.json").write_text(json.dumps({**config, "hidden_size": 128}))
    moved = tmp_path / "moved"
    moved.mkdir()
    for file in adapters[0].iterdir():
        (moved / file.name).write_bytes(file.read_bytes())
    adapter_config = json.loads((moved / "adapter_config.json").read_text())
    (moved / "adapter_config.json").write_text(
        json.dumps({**adapter_config, "base_model_name_or_path": str(other_base)})
    )
    with pytest.raises(ValueError, match=f"was trained on {other_base}.*hidden_size \\(128 vs 64\\)"):
        PactModelForCausalLM.from_pretrained(str(small_model), adapter=str(moved), dtype="float32")


def test_merged_export_loads_in_plain_transformers_and_computes_what_the_adapter_did(small_model, adapters, tmp_path):
    out = export_merged(adapters[0], tmp_path / "merged", str(small_model), dtype=torch.float32)
    plain = AutoModelForCausalLM.from_pretrained(out)  # no PACT, no peft
    assert not any(isinstance(m, FrozenLinear) for m in plain.modules()) and not hasattr(plain, "peft_config")
    pact = PactModelForCausalLM.from_pretrained(str(small_model), adapter=str(adapters[0]), dtype="float32")
    with torch.no_grad():
        expected, got = pact.model(input_ids=PROMPT).logits, plain(input_ids=PROMPT).logits
    torch.testing.assert_close(got, expected, atol=1e-4 * expected.abs().max().item(), rtol=0)
    assert (out / "tokenizer.json").is_file()


def test_pact_export_refuses_a_non_empty_output_and_a_folder_without_an_adapter(
    small_model, adapters, tmp_path, capsys
):
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "keep.txt").write_text("mine")
    base = ["export", "--model", str(small_model), "--format", "merged-bf16"]
    assert main([*base, "--adapter", str(adapters[0]), "--output", str(taken)]) == 2
    assert "exists and is not empty" in capsys.readouterr().err and (taken / "keep.txt").read_text() == "mine"
    assert main([*base, "--adapter", str(tmp_path), "--output", str(tmp_path / "new")]) == 2
    assert "has no adapter_config.json" in capsys.readouterr().err and not (tmp_path / "new").exists()
    assert main([*base, "--adapter", str(adapters[0]), "--output", str(tmp_path / "new")]) == 0
    assert (tmp_path / "new" / "model.safetensors").is_file()


def test_adapter_takes_one_value_per_flag_so_the_prompt_is_not_swallowed():
    args, prompt = parse(["--adapter", "runs/sam", "Leo lost another tooth"], "generate")
    assert args.adapter == ["runs/sam"] and prompt == "Leo lost another tooth"
    args, prompt = parse(["--adapter", "a=runs/a", "--adapter", "b=runs/b", "--use", "b", "hi"], "generate")
    assert args.adapter == ["a=runs/a", "b=runs/b"] and args.use == "b" and prompt == "hi"


def test_pact_version(capsys):
    from importlib.metadata import version

    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"pact (optimum-pact) {version('optimum-pact')}"


def _tagging_adapter(adapter, out, labels):
    from optimum_pact.commands.data.trained_on import TrainedOn

    out.mkdir()
    for file in adapter.iterdir():
        (out / file.name).write_bytes(file.read_bytes())
    TrainedOn.of("labelled", [{"text": "x", "label": label} for label in labels]).save(out)
    return out


def test_a_tagging_adapter_is_prompted_as_trained_and_answers_no_longer_than_its_longest_tag(
    small_model, adapters, tmp_path, capsys
):
    from optimum_pact.commands.data import PROMPT_TEMPLATE

    tagger = _tagging_adapter(adapters[0], tmp_path / "tagger", ["kin", "wheels", "tally"])
    pact = PactModelForCausalLM.from_pretrained(str(small_model), adapter=str(tagger), dtype="float32")
    expected = pact.tokenizer(PROMPT_TEMPLATE.format(text="Leo lost another tooth"))["input_ids"]
    assert pact.prompt_ids("  Leo lost another tooth ")[0].tolist() == expected
    chat = [{"role": "user", "content": "MOT due"}, {"role": "assistant", "content": " wheels"}]
    chat.append({"role": "user", "content": "Leo lost another tooth"})
    assert pact.prompt_ids(chat)[0].tolist() == expected  # in a chat each message is tagged on its own
    longest = max(len(pact.tokenizer(" " + t, add_special_tokens=False)["input_ids"]) for t in ["kin", "wheels"])
    assert pact.max_answer_tokens() == longest + 1
    # this random adapter never says EOS: the answer is still cut where a trained one would have stopped
    argv = ["generate", "--model", str(small_model), "--adapter", str(tagger), "--dtype", "float32", "a note"]
    assert main(argv) == 0
    ids = pact.prompt_ids("a note")
    capped, free = (pact.generate(input_ids=ids, max_new_tokens=n, do_sample=False) for n in (longest + 1, 12))
    decode = pact.tokenizer.decode
    assert capsys.readouterr().out.strip() == decode(capped[0, ids.shape[1] :], skip_special_tokens=True).strip()
    assert free.shape[1] > capped.shape[1]  # uncapped, this adapter would have gone on
    args, _ = parse(["--model", str(small_model), "--adapter", str(tagger), "--dtype", "float32"], "chat")
    run_chat(args, lines=["a note", "another"])
    assert capsys.readouterr().out.count("this adapter tags notes: each message gets one of its 3 tags") == 1


def test_the_record_of_what_an_adapter_learned(tmp_path):
    from optimum_pact.commands.data.trained_on import TrainedOn

    system = {"role": "system", "content": "You are Sam."}
    talk = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hey"}]
    assert TrainedOn.of("chat", [{"messages": [system, *talk]}] * 2).system == "You are Sam."
    assert TrainedOn.of("chat", [{"messages": [system, *talk]}, {"messages": talk}]).system is None
    record = TrainedOn.of("labelled", [{"text": "a", "label": "kin"}, {"text": "b", "label": "tally"}])
    record.save(tmp_path)
    assert TrainedOn.load(tmp_path) == record and record.labels == ["kin", "tally"]
    (tmp_path / "pact_data.json").write_text("{not json")
    with pytest.raises(ValueError, match="pact_data.json is damaged"):
        TrainedOn.load(tmp_path)
    assert TrainedOn.load(tmp_path / "elsewhere") is None


def test_without_a_base_the_adapter_s_own_base_is_loaded(small_model, adapters, tmp_path):
    """As peft's AutoPeftModelForCausalLM: --model left out loads the base the adapter records, where it is here."""
    pact = PactModelForCausalLM.from_pretrained(adapter=str(adapters[0]), dtype="float32")
    assert pact.base_path == str(small_model)
    elsewhere = tmp_path / "moved"
    shutil.copytree(adapters[0], elsewhere)
    config = json.loads((elsewhere / "adapter_config.json").read_text())
    (elsewhere / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": "/gone/model"}))
    from optimum_pact.commands.default_model import ensure_default_model
    from optimum_pact.commands.model_folder import resolve_model

    assert resolve_model(None, elsewhere) == str(ensure_default_model())  # not here: the default model, as before
