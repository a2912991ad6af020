"""`--engine llama.cpp` with the GGUF cached: llama.cpp alone answers, as the full path would, without torch."""

import shutil

import pytest
from conftest import main_in_a_fresh_process
from test_generation import _adapter
from transformers import AutoTokenizer, HfArgumentParser

from optimum_pact.commands.cli import main
from optimum_pact.commands.data import load_personal_dataset
from optimum_pact.commands.data.trained_on import TrainedOn
from optimum_pact.commands.generate_options import EngineArguments, light_parser
from optimum_pact.commands.generation import GenerateArguments
from optimum_pact.commands.llama_engine import cached_gguf
from optimum_pact.commands.llama_quick import QuickModel, quick_run
from optimum_pact.commands.modeling import prompt_ids

pytest.importorskip("llama_cpp", reason="needs llama-cpp-python (optimum-pact[llama])")


@pytest.fixture(scope="module")
def exported(small_model, tmp_path_factory):
    """A tagging adapter (the main job's notes) with its GGUF cached, as a first --engine llama.cpp run leaves it."""
    adapter = _adapter(small_model, tmp_path_factory.mktemp("quick") / "adapter", seed=1)
    train, heldout = load_personal_dataset()
    TrainedOn.of("labelled", train + heldout).save(adapter)
    return adapter, cached_gguf(adapter, str(small_model))


def test_the_ggufs_tokenizer_and_template_give_the_full_paths_prompt_ids(small_model, exported):
    adapter, gguf = exported
    tokenizer = AutoTokenizer.from_pretrained(small_model)
    _, heldout = load_personal_dataset()
    records = [
        TrainedOn.load(adapter),  # a tagging adapter: its prompt around the note
        TrainedOn("chat", system="You tag notes."),  # a chat adapter: the template, its training's system message
        TrainedOn("chat"),
        None,  # plain text
    ]
    messages = [{"role": "user", "content": "Leo's dentist, Friday 3pm"}, {"role": "assistant", "content": "health"},
                {"role": "user", "content": "ünïcode — and \"quotes\" ☕"}]  # fmt: skip
    for record in records:
        quick = QuickModel(gguf, record, 2048)
        try:
            for item in heldout[:20]:
                assert quick.prompt_ids(item["text"]) == prompt_ids(tokenizer, record, item["text"])[0].tolist()
            assert quick.prompt_ids(messages) == prompt_ids(tokenizer, record, messages)[0].tolist()
        finally:
            quick.close()


def test_the_quick_path_answers_as_the_full_path_does(small_model, exported, capsys, monkeypatch):
    adapter, _ = exported
    argv = ["--model", str(small_model), "--adapter", str(adapter), "--engine", "llama.cpp", "--max_new_tokens", "6"]
    for prompt in ("Leo lost another tooth", "dentist appointment for Leo on Friday"):
        assert quick_run("generate", [*argv, prompt]) == 0
        quick = capsys.readouterr()
        monkeypatch.setattr("optimum_pact.commands.llama_quick.quick_run", lambda *a, **k: None)  # the full path
        assert main(["generate", *argv, prompt]) == 0
        full = capsys.readouterr()
        monkeypatch.undo()
        assert quick.out == full.out and quick.out.strip() and not quick.err
    lines = ["Leo lost another tooth", "/reset", "book the dentist"]
    assert quick_run("chat", argv, lines=lines) == 0
    out = capsys.readouterr().out
    assert out.startswith("note: this adapter tags notes") and "(conversation reset)" in out
    assert quick_run("generate", [*argv[:-2], "--max_new_tokens", "9000", "hi"]) == 2  # the context, as the full path
    assert "exceeds the model's 2048-token context" in capsys.readouterr().err


def test_the_quick_path_steps_aside_where_it_cannot_answer(small_model, exported, tmp_path):
    adapter, _ = exported
    argv = ["--model", str(small_model), "--adapter", str(adapter), "hi"]
    assert quick_run("generate", argv) is None  # the pact engine
    assert quick_run("generate", [*argv[:-1], "--engine", "llama.cpp", "--dtype", "float32", "hi"]) is None
    assert quick_run("generate", [*argv[:-1], "--engine", "llama.cpp", "--use", "nobody", "hi"]) is None
    stale = shutil.copytree(adapter, tmp_path / "stale")
    (stale / "adapter_model.safetensors").write_bytes(b"retrained")  # another adapter than the GGUF's
    assert quick_run("generate", ["--model", str(small_model), "--adapter", str(stale), "--engine", "llama.cpp",
                                  "hi"]) is None  # fmt: skip


def test_the_light_parser_reads_what_hfargumentparser_reads():
    argv = ["--adapter", "a", "--adapter", "jo=b", "--use", "jo", "--max-new-tokens", "7", "--temperature", "0.5",
            "--top_p", "0.9", "--engine", "llama.cpp", "--model", "m"]  # fmt: skip
    light = light_parser("chat").parse_args(argv)
    parser = HfArgumentParser(GenerateArguments)
    next(action for action in parser._actions if action.dest == "adapter").nargs = None
    (full,) = parser.parse_args_into_dataclasses(argv)
    for name in EngineArguments.__dataclass_fields__:
        assert getattr(light, name) == getattr(full, name), name
    with pytest.raises(ValueError):
        light_parser("chat").parse_args([*argv, "--backend", "torch"])  # the pact engine's option: the full path


def test_a_cached_answer_imports_neither_torch_nor_transformers_nor_peft(small_model, exported):
    adapter, _ = exported
    argv = ["generate", "--model", str(small_model), "--adapter", str(adapter), "--engine", "llama.cpp",
            "--max_new_tokens", "3", "Leo lost another tooth"]  # fmt: skip
    rc, imported, out, err = main_in_a_fresh_process(argv, ("torch", "transformers", "peft"))
    assert (rc, imported, err) == (0, [], ""), out + err
