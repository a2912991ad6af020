import json
from collections import Counter

import pytest

from optimum_pact.commands.data import DEFAULT_DATA, PROMPT_TEMPLATE, format_example, load_personal_dataset


def write_lines(tmp_path, lines: list[str], name: str = "notes.jsonl"):
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def records(n_per_label: int = 10, labels=("a", "b", "c")) -> list[str]:
    return [
        json.dumps({"text": f"note {i} about {label}", "label": label}) for label in labels for i in range(n_per_label)
    ]


def test_shipped_dataset_loads():
    train, heldout = load_personal_dataset()
    assert DEFAULT_DATA.is_file()
    assert train and heldout
    labels = {e["label"] for e in train}
    assert len(labels) >= 6
    assert {e["label"] for e in heldout} == labels
    assert all(set(e) == {"text", "label"} for e in train + heldout)
    counts = Counter(e["label"] for e in heldout)
    totals = Counter(e["label"] for e in train + heldout)
    for label in labels:
        assert 0.1 <= counts[label] / totals[label] <= 0.3
    assert not {e["text"] for e in train} & {e["text"] for e in heldout}


def test_format_example():
    prompt, target = format_example("buy milk", "kin")
    assert prompt == PROMPT_TEMPLATE.format(text="buy milk") == "Note: buy milk\nTag:"
    assert target == " kin"


def test_missing_file(tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_personal_dataset(missing)


def test_bad_json_names_line(tmp_path):
    lines = records()
    lines[3] = '{"text": "oops", "label": '
    path = write_lines(tmp_path, lines)
    with pytest.raises(ValueError, match=r"line 4: invalid JSON.*each line needs") as info:
        load_personal_dataset(path)
    assert str(path) in str(info.value)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"label": "a"}', 'missing "text" field'),
        ('{"text": "hello"}', 'missing "label" field'),
        ('{"text": 5, "label": "a"}', '"text" must be a string, got int'),
        ('{"text": "hello", "label": ["a"]}', '"label" must be a string, got list'),
        ('{"text": "   ", "label": "a"}', '"text" is empty'),
        ('{"text": "hello", "label": ""}', '"label" is empty'),
        ('["hello", "a"]', "expected a JSON object, got list"),
        ('{"text": "hello", "label": "a", "split": "dev"}', '"split" must be "train" or "test"'),
    ],
)
def test_invalid_records_name_line_and_field(tmp_path, line, message):
    lines = records()
    lines.insert(1, line)
    with pytest.raises(ValueError, match="line 2") as info:
        load_personal_dataset(write_lines(tmp_path, lines))
    assert message in str(info.value)


def test_blank_lines_are_skipped_and_line_numbers_stay_right(tmp_path):
    lines = records()
    lines[5:5] = ["", '{"text": "x"}']
    with pytest.raises(ValueError, match='line 7: missing "label"'):
        load_personal_dataset(write_lines(tmp_path, lines))


def test_needs_two_labels(tmp_path):
    with pytest.raises(ValueError, match="at least 2 distinct labels"):
        load_personal_dataset(write_lines(tmp_path, records(labels=("only",))))


def test_empty_file(tmp_path):
    with pytest.raises(ValueError, match="no examples"):
        load_personal_dataset(write_lines(tmp_path, [""]))


def test_explicit_split_empty_heldout(tmp_path):
    lines = [json.dumps({"text": f"n{i}", "label": "ab"[i % 2], "split": "train"}) for i in range(10)]
    with pytest.raises(ValueError, match="held-out"):
        load_personal_dataset(write_lines(tmp_path, lines))


def test_partial_split_field(tmp_path):
    lines = [json.dumps({"text": f"n{i}", "label": "ab"[i % 2], "split": "train"}) for i in range(10)]
    lines[6] = json.dumps({"text": "n6", "label": "a"})
    with pytest.raises(ValueError, match='line 7: no "split" field'):
        load_personal_dataset(write_lines(tmp_path, lines))


def test_explicit_split_is_respected(tmp_path):
    lines = [
        json.dumps({"text": f"n{i}", "label": "ab"[i % 2], "split": "test" if i < 2 else "train"}) for i in range(10)
    ]
    train, heldout = load_personal_dataset(write_lines(tmp_path, lines))
    assert [e["text"] for e in heldout] == ["n0", "n1"]
    assert len(train) == 8


def test_auto_split_is_stratified_and_deterministic(tmp_path):
    path = write_lines(tmp_path, records(n_per_label=10))
    train, heldout = load_personal_dataset(path)
    assert Counter(e["label"] for e in heldout) == {"a": 2, "b": 2, "c": 2}
    assert len(train) == 24
    again = load_personal_dataset(write_lines(tmp_path, records(n_per_label=10), name="copy.jsonl"))
    assert again == (train, heldout)


def test_auto_split_single_example_label_stays_in_train(tmp_path):
    lines = records(n_per_label=5, labels=("a", "b")) + [json.dumps({"text": "lonely", "label": "c"})]
    train, heldout = load_personal_dataset(write_lines(tmp_path, lines))
    assert "c" in {e["label"] for e in train}
    assert "c" not in {e["label"] for e in heldout}
