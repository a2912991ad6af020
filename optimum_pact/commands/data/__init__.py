"""The built-in personal dataset (one user's phone notes, each with one of their own tags) and its loader."""

from __future__ import annotations

import json
import random
from pathlib import Path

DEFAULT_DATA: Path = Path(__file__).parent / "notes.jsonl"
PROMPT_TEMPLATE = "Note: {text}\nTag:"
HELDOUT_FRACTION = 0.2
SPLIT_SEED = 0
_SHAPE = 'each line needs {"text": ..., "label": ...} (optionally "split": "train" or "test")'


def format_example(text: str, label: str) -> tuple[str, str]:
    """Return (prompt, target) for one note; the target is " " + label, scored/trained after the prompt."""
    return PROMPT_TEMPLATE.format(text=text), " " + label


def _parse_line(path: Path, lineno: int, line: str) -> tuple[dict, str | None]:
    where = f"{path}, line {lineno}"
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: invalid JSON ({e.msg}); {_SHAPE}") from None
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}; {_SHAPE}")
    example = {}
    for field in ("text", "label"):
        if field not in record:
            raise ValueError(f'{where}: missing "{field}" field; {_SHAPE}')
        value = record[field]
        if not isinstance(value, str):
            raise ValueError(f'{where}: "{field}" must be a string, got {type(value).__name__}; {_SHAPE}')
        if not value.strip():
            raise ValueError(f'{where}: "{field}" is empty; {_SHAPE}')
        example[field] = value.strip()
    split = record.get("split")
    if split is not None and split not in ("train", "test"):
        raise ValueError(f'{where}: "split" must be "train" or "test", got {split!r}; or leave it out everywhere')
    return example, split


def _auto_split(examples: list[dict]) -> tuple[list[dict], list[dict]]:
    """Deterministic stratified split: about HELDOUT_FRACTION of each label (at least 1 if it has 2+) is held out."""
    by_label: dict[str, list[int]] = {}
    for index, example in enumerate(examples):
        by_label.setdefault(example["label"], []).append(index)
    heldout_indices: set[int] = set()
    for label in sorted(by_label):
        indices = by_label[label]
        count = max(1, round(HELDOUT_FRACTION * len(indices))) if len(indices) >= 2 else 0
        heldout_indices.update(random.Random(f"{SPLIT_SEED}:{label}").sample(indices, count))
    train = [e for i, e in enumerate(examples) if i not in heldout_indices]
    heldout = [e for i, e in enumerate(examples) if i in heldout_indices]
    return train, heldout


def load_personal_dataset(path: str | Path | None = None) -> tuple[list[dict], list[dict]]:
    """Load a JSONL file of {"text", "label"[, "split"]} lines and return (train, heldout) lists of {"text", "label"}.

    Without "split" fields, about 20% of each label is held out, deterministically. Blank lines are ignored.
    """
    path = Path(path) if path is not None else DEFAULT_DATA
    if not path.is_file():
        raise FileNotFoundError(f"personal dataset not found: {path} (a JSONL file; {_SHAPE})")
    examples: list[dict] = []
    splits: list[tuple[int, str | None]] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if line.strip():
                example, split = _parse_line(path, lineno, line)
                examples.append(example)
                splits.append((lineno, split))
    if not examples:
        raise ValueError(f"{path}: no examples; {_SHAPE}")
    labels = {e["label"] for e in examples}
    if len(labels) < 2:
        raise ValueError(f"{path}: needs at least 2 distinct labels to classify, found {sorted(labels)}")
    given = [split for _, split in splits if split is not None]
    if not given:
        train, heldout = _auto_split(examples)
    elif len(given) < len(splits):
        lineno = next(n for n, split in splits if split is None)
        raise ValueError(f'{path}, line {lineno}: no "split" field while other lines have one; give every line one')
    else:
        train = [e for e, (_, split) in zip(examples, splits) if split == "train"]
        heldout = [e for e, (_, split) in zip(examples, splits) if split == "test"]
    if not train or not heldout:
        empty = "train" if not train else "held-out (test)"
        raise ValueError(f"{path}: the {empty} split is empty; put about 20% of each label in each split")
    unseen = sorted({e["label"] for e in heldout} - {e["label"] for e in train})
    if unseen:
        raise ValueError(f"{path}: labels {unseen} appear only in the held-out split; add training examples for them")
    return train, heldout
