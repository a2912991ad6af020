"""The pact engine's quick path: the packed base and one adapter answer without importing transformers or peft, with
the full path's logits bit for bit, and step aside wherever they could not."""

import json
import shutil

import pytest
import torch
from conftest import TINY, main_in_a_fresh_process
from safetensors.torch import load_file
from test_use_path import _train_time_model
from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

from optimum_pact.commands.cli import main
from optimum_pact.commands.data import load_personal_dataset
from optimum_pact.commands.data.trained_on import TrainedOn
from optimum_pact.commands.generate_options import light_parser
from optimum_pact.commands.modeling import PactModelForCausalLM, prompt_ids
from optimum_pact.commands.pact_quick import load_quick, quick_run
from optimum_pact.decoder import PackedDecoder

STEPS = 8


@pytest.fixture(scope="module")
def small_qwen2(small_model, tmp_path_factory):
    """small_model's tokenizer on a 2-block Qwen2 (q/k/v biases, untied head) of random weights."""
    folder = tmp_path_factory.mktemp("small_qwen2")
    tokenizer = AutoTokenizer.from_pretrained(small_model)
    torch.manual_seed(0)
    config = Qwen2Config(**{**TINY, "vocab_size": len(tokenizer), "tie_word_embeddings": False})
    Qwen2ForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _used(base, adapter):
    """The full path's model (which packs the base into the cache) and the quick path's, for `adapter`."""
    used = PactModelForCausalLM.from_pretrained(str(base), adapter=str(adapter))
    quick = load_quick(light_parser("chat").parse_args(["--model", str(base), "--adapter", str(adapter)]))
    assert quick is not None
    return used, quick


def _full_logits(used, ids):
    out = used.generate(input_ids=ids, max_new_tokens=STEPS, min_new_tokens=STEPS, output_logits=True,
                        return_dict_in_generate=True)  # fmt: skip
    return out.sequences[0, ids.shape[1] :], [logits.float() for logits in out.logits]


def _quick_logits(decoder, ids, tokens):
    cache, step, logits = [], ids, []
    for token in tokens:
        logits.append(decoder.next_logits(step, cache))
        step = token.view(1, 1)
    return logits


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_the_quick_decoder_computes_the_full_paths_logits_bit_for_bit(arch, dtype, small_model, small_qwen2, tmp_path):
    base = small_model if arch == "llama" else small_qwen2
    _, adapter = _train_time_model(base, tmp_path / "a", dtype, 0, protect_fraction=0.25, rank_by="nvfp4")
    used, quick = _used(base, adapter)
    assert quick.decoder.dtype == dtype
    formats = {name: layer.base.precision for name, layer in quick.decoder.linears.items()}
    sixteen = used.model.peft_config["default"].sixteen_bit_modules()
    assert sorted(n for n, p in formats.items() if p == "fp16") == sixteen
    assert all(layer.lora is not None for layer in quick.decoder.linears.values())
    ids = used.prompt_ids("Leo lost another tooth")
    assert quick.prompt_ids("Leo lost another tooth") == ids[0].tolist()
    tokens, full = _full_logits(used, ids)
    mine = _quick_logits(quick.decoder, ids, tokens)
    for step, (a, b) in enumerate(zip(mine, full)):
        assert torch.equal(a, b), f"step {step}: max difference {(a - b).abs().max()}"
    assert quick.decoder.greedy(ids[0].tolist(), STEPS, set()) == tokens.tolist()


def test_a_wrong_scaling_or_no_adapter_differs_so_the_test_above_can_fail(small_model, tmp_path):
    _, adapter = _train_time_model(small_model, tmp_path / "a", torch.bfloat16, 0, protect_fraction=0.25)
    used, quick = _used(small_model, adapter)
    ids = used.prompt_ids("Leo lost another tooth")
    tokens, full = _full_logits(used, ids)
    packed = PackedDecoder.from_folder(quick.decoder.folder)
    assert not torch.equal(_quick_logits(packed, ids, tokens)[0], full[0])  # the base alone
    packed.add_lora(load_file(str(adapter / "adapter_model.safetensors")), 2.0 * 1.25)  # alpha / r is 2.0
    assert not torch.equal(_quick_logits(packed, ids, tokens)[0], full[0])


@pytest.fixture(scope="module")
def tagging(small_model, tmp_path_factory):
    """A tagging adapter (the main job's notes) whose base is packed, as the first full-path call leaves it."""
    _, adapter = _train_time_model(small_model, tmp_path_factory.mktemp("tagging") / "a", torch.bfloat16, 1,
                                   protect_fraction=0.25)  # fmt: skip
    train, heldout = load_personal_dataset()
    TrainedOn.of("labelled", train + heldout).save(adapter)
    PactModelForCausalLM.from_pretrained(str(small_model), adapter=str(adapter))
    return adapter


def _full_path(monkeypatch):
    monkeypatch.setattr("optimum_pact.commands.pact_quick.quick_run", lambda *a, **k: None)


@pytest.mark.parametrize("tags", [True, False], ids=["tagging", "plain"])
def test_pact_generate_and_chat_print_what_the_full_path_prints(
    small_model, tagging, tags, tmp_path, capsys, monkeypatch
):
    adapter = tagging
    if not tags:  # the same weights without the record of what they learned: a plain text prompt
        adapter = shutil.copytree(tagging, tmp_path / "plain")
        (adapter / "pact_data.json").unlink()
    argv = ["--model", str(small_model), "--adapter", str(adapter), "--max_new_tokens", "7"]
    for prompt in ("Leo lost another tooth", "dentist appointment for Leo on Friday", "ünïcode ☕"):
        assert quick_run("generate", [*argv, prompt]) == 0
        quick = capsys.readouterr()
        _full_path(monkeypatch)
        assert main(["generate", *argv, prompt]) == 0
        full = capsys.readouterr()
        monkeypatch.undo()
        assert quick.out == full.out and quick.out.strip() and not quick.err
    if tags:
        lines = ["Leo lost another tooth", "/reset", "book the dentist"]
        assert quick_run("chat", argv, lines=lines) == 0
        quick = capsys.readouterr().out
        _full_path(monkeypatch)
        monkeypatch.setattr("optimum_pact.commands.generate_options.stdin_lines", lambda: iter(lines))
        monkeypatch.setattr("optimum_pact.commands.generation.stdin_lines", lambda: iter(lines))
        assert main(["chat", *argv]) == 0
        assert quick == capsys.readouterr().out and quick.startswith("note: this adapter tags notes")


def test_the_chat_template_gives_the_full_paths_prompt_ids(small_model, tagging):
    tokenizer = AutoTokenizer.from_pretrained(small_model)
    quick = load_quick(light_parser("chat").parse_args(["--model", str(small_model), "--adapter", str(tagging)]))
    _, heldout = load_personal_dataset()
    messages = [{"role": "user", "content": "Leo's dentist, Friday 3pm"}, {"role": "assistant", "content": "health"},
                {"role": "user", "content": "ünïcode — and \"quotes\" ☕"}]  # fmt: skip
    for record in (TrainedOn.load(tagging), TrainedOn("chat", system="You tag notes."), TrainedOn("chat"), None):
        quick.trained_on = record
        for item in heldout[:10]:
            assert quick.prompt_ids(item["text"]) == prompt_ids(tokenizer, record, item["text"])[0].tolist()
        assert quick.prompt_ids(messages) == prompt_ids(tokenizer, record, messages)[0].tolist()
    assert quick.has_template and quick.prompt_ids(messages) != quick.tokenizer.encode(messages[-1]["content"]).ids


def test_the_command_imports_neither_transformers_nor_peft(small_model, tagging):
    argv = ["generate", "--model", str(small_model), "--adapter", str(tagging), "Leo lost a tooth"]
    heavy = ("transformers", "peft", "peft_ext", "trainer_callbacks")
    rc, imported, answer, err = main_in_a_fresh_process(argv, heavy)
    assert (rc, imported, err) == (0, [], "") and answer.strip()  # random weights: any answer, up to the longest tag


def test_the_quick_path_steps_aside_where_it_cannot_answer(small_model, tagging, tmp_path):
    argv = ["--model", str(small_model), "--adapter", str(tagging)]
    assert quick_run("generate", [*argv, "hi"]) == 0
    for extra in (["--temperature", "0.7"], ["--dtype", "float32"], ["--backend", "torch"], ["--engine", "llama.cpp"],
                  ["--adapter", f"b={tagging}"], ["--use", "nobody"]):  # fmt: skip
        assert quick_run("generate", [*argv, *extra, "hi"]) is None, extra
    dora = shutil.copytree(tagging, tmp_path / "dora")
    config = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    assert quick_run("generate", ["--model", str(small_model), "--adapter", str(dora), "hi"]) is None
    unpacked = shutil.copytree(small_model, tmp_path / "base")  # another checkpoint: no packed folder yet
    assert quick_run("generate", ["--model", str(unpacked), "--adapter", str(tagging), "hi"]) is None
    tokenizer_config = small_model / "tokenizer_config.json"  # the base's own file (not in the packed key), restored
    original = tokenizer_config.read_text()
    try:
        tokenizer_config.write_text(json.dumps({**json.loads(original), "add_bos_token": True}))
        assert quick_run("generate", [*argv, "hi"]) is None  # transformers would rebuild its post-processor
    finally:
        tokenizer_config.write_text(original)
    assert quick_run("generate", [*argv, "hi"]) == 0
    other = shutil.copytree(tagging, tmp_path / "other")
    (other / "adapter_model.safetensors").write_bytes(b"damaged")  # the full path says what is wrong
    assert quick_run("generate", ["--model", str(small_model), "--adapter", str(other), "hi"]) is None
    (other / "pact_config.json").write_text(json.dumps({"protected_modules": ["model.layers.0.mlp.up_proj"]}))
    assert quick_run("generate", ["--model", str(small_model), "--adapter", str(other), "hi"]) is None  # not packed
