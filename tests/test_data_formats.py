"""The data people have: chat, prompt/completion and plain text, beside the labelled items (issue 14, part 0)."""

import json
import math

import pytest
from transformers import AutoTokenizer

from optimum_pact.commands.cli import main
from optimum_pact.commands.data.generative import (
    EXAMPLES,
    file_format,
    load_generative_dataset,
    prompt_ids,
    tokenize_generative,
)
from optimum_pact.commands.default_model import ensure_default_model

CHAT = {"messages": [{"role": "user", "content": "hi?"}, {"role": "assistant", "content": "hello there"}]}
PC = {"prompt": "Q: 2+2?\nA:", "completion": " four"}
TEXT = {"text": "dear diary, a quiet day."}


def _write(tmp_path, records, name="data.jsonl"):
    path = tmp_path / name
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in records) + "\n")
    return path


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(ensure_default_model())


@pytest.mark.parametrize(
    ("record", "form"),
    [(CHAT, "chat"), (PC, "prompt_completion"), (TEXT, "text"), ({"text": "x", "label": "y"}, "labelled")],
)
def test_the_format_is_read_from_the_first_line(tmp_path, record, form):
    assert file_format(_write(tmp_path, ["", record, {"unrelated": 1}])) == form


def test_built_in_examples_load_with_a_held_out_split():
    for form in ("chat", "prompt_completion", "text"):
        data = load_generative_dataset(EXAMPLES / f"{form}.jsonl")
        assert data.format == form and len(data.train) >= 20 and len(data.heldout) >= 5


@pytest.mark.parametrize(
    ("records", "needle"),
    [
        ([PC, TEXT], "line 2: a text item in a prompt_completion file"),
        ([CHAT, PC], "line 2: a prompt_completion item in a chat file"),
        ([{"messages": [{"role": "user", "content": "hi"}]}], "line 1: no assistant message"),
        ([{"messages": [{"role": "bot", "content": "hi"}]}], "line 1: message 0 needs a role"),
        ([PC, {"prompt": "", "completion": "x"}], 'line 2: "prompt" must be a non-empty string'),
        ([PC, "{not json"], "line 2: invalid JSON"),
        ([PC, {"answer": 1}], "line 2: not an item of a known format"),
        ([{**PC, "split": "train"}, PC], 'line 2: no "split" field'),
        ([{**PC, "split": "dev"}], '"split" must be "train" or "test"'),
    ],
)
def test_each_lines_problem_is_reported_with_its_line(tmp_path, records, needle):
    with pytest.raises(ValueError, match=needle.replace("(", r"\(")):
        load_generative_dataset(_write(tmp_path, records))


def test_without_split_fields_a_fifth_is_held_out_deterministically(tmp_path):
    path = _write(tmp_path, [{"prompt": f"q{i}", "completion": f" a{i}"} for i in range(20)])
    first, again = load_generative_dataset(path), load_generative_dataset(path)
    assert len(first.heldout) == 4 and first.heldout == again.heldout
    assert not {i["prompt"] for i in first.train} & {i["prompt"] for i in first.heldout}


def _learned(tokenizer, row) -> str:
    return tokenizer.decode([t for t, label in zip(row["input_ids"], row["labels"]) if label != -100])


def test_the_loss_sees_the_completion_only(tokenizer):
    (row,) = tokenize_generative(tokenizer, [PC], "prompt_completion")
    assert _learned(tokenizer, row) == " four" + tokenizer.eos_token
    assert (
        row["input_ids"][: len(prompt_ids(tokenizer, PC, "prompt_completion"))] == tokenizer(PC["prompt"])["input_ids"]
    )


def test_the_loss_sees_the_assistant_turns_only(tokenizer):
    chat = {
        "messages": [*CHAT["messages"], {"role": "user", "content": "again?"}, {"role": "assistant", "content": "yes"}]
    }
    (row,) = tokenize_generative(tokenizer, [chat], "chat")
    assert _learned(tokenizer, row) == "hello there<|im_end|>\nyes<|im_end|>\n"
    assert row["input_ids"] == list(tokenizer.apply_chat_template(chat["messages"], tokenize=True)["input_ids"])
    prompt = tokenizer.decode(prompt_ids(tokenizer, chat, "chat"))
    assert prompt.endswith("again?<|im_end|>\n<|im_start|>assistant\n")


def test_plain_text_is_learned_whole(tokenizer):
    (row,) = tokenize_generative(tokenizer, [TEXT], "text")
    assert all(label != -100 for label in row["labels"]) and _learned(tokenizer, row).startswith(TEXT["text"])


def test_main_job_on_prompt_completion_reports_loss_perplexity_and_answers(small_model, tmp_path, capsys):
    data = _write(tmp_path, [{"prompt": f"Q{i}: colour?\nA:", "completion": " blue"} for i in range(10)])
    out = tmp_path / "run"
    args = ["finetune", "--model", str(small_model), "--data", str(data), "--output", str(out), "--max-steps", "30"]
    # the base rounded to nearest, as this lr was chosen on: this random base is fragile (lr 0.05 stalls near 10.1,
    # and so does lr 0.02 on its GPTQ rounding over these 8 one-word items); the format is the question here
    assert main([*args, "--dtype", "float32", "--learning_rate", "0.02", "--rounding", "nearest"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["data_format"] == "prompt_completion" and summary["accuracy_before"] is None
    # " blue" every time: learnable in a few steps (11.02 -> 9.58)
    assert summary["loss_after"] < summary["loss_before"] - 1
    assert summary["example_prompt"].endswith("colour?\nA:") and summary["answer_after"] is not None
    printed = capsys.readouterr().out
    assert f"held-out perplexity     {math.exp(summary['loss_before']):.2f}" in printed
    assert "adapter answers" in printed.splitlines()[-1]
    assert "held-out loss per token before" in (out / "adapter" / "README.md").read_text()


@pytest.mark.slow
def test_main_job_on_the_built_in_chat_example_learns_the_persons_replies(tmp_path):
    out = tmp_path / "run"
    assert main(["finetune", "--data", "chat", "--max_steps", "20", "--output", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert math.exp(summary["loss_after"]) < math.exp(summary["loss_before"]) / 4  # perplexity 198 -> 13 measured
    assert summary["answer_after"].endswith("— sam")  # the adapter signs off as the person does
