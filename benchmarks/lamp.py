"""LaMP-2 (personalized movie tagging) in the official LaMP JSON format: loader, per-user tasks, official metrics.

The official files (https://lamp-benchmark.github.io) are not reachable from here; this reads them when you have them.
A questions file is a JSON list of

    {"id": "110", "input": "Which tag does this movie relate to among the following tags? ... description: <plot>",
     "profile": [{"id": "1100", "tag": "comedy", "description": "<plot>"}, ...]}

and an outputs file is `{"task": "LaMP_2", "golds": [{"id": "110", "output": "comedy"}, ...]}`. Each question is one
user: their profile (movies they tagged before) is the training set, the question the held-out item. The metrics are
the official ones (LaMP `metrics/classification_metrics.py`): predictions and golds are stripped and mapped to their
index among the 15 tags (-1 when not a tag), accuracy over those indices, and macro-F1 over the 15 tags with
sklearn's convention that a tag with no true and no predicted items scores 0.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

LAMP2_TAGS = (
    "sci-fi", "based on a book", "comedy", "action", "twist ending", "dystopia", "dark comedy", "classic",
    "psychology", "fantasy", "romance", "thought-provoking", "social commentary", "violence", "true story",
)  # fmt: skip
QUESTIONS_SCHEMA = 'a JSON list of {"id": str, "input": str, "profile": [{"id": str, "tag": str, "description": str}]}'
OUTPUTS_SCHEMA = '{"task": "LaMP_2", "golds": [{"id": str, "output": str}]}'
DESCRIPTION_MARKER = "description:"
PROFILE_FIELDS = ("id", "tag", "description")


@dataclass(frozen=True)
class LampQuestion:
    id: str
    input: str
    profile: tuple[dict, ...]  # {"id", "tag", "description"} per movie the user tagged before
    output: str | None = None  # the gold tag, when an outputs file was given

    @property
    def description(self) -> str:
        """The movie to tag: the text after 'description:' in the input (the whole input when it has none)."""
        head, marker, tail = self.input.rpartition(DESCRIPTION_MARKER)
        return tail.strip() if marker else self.input.strip()


def _field(record, name: str, kind: type, where: str, schema: str):
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}; the schema is {schema}")
    if name not in record:
        raise ValueError(f'{where}: missing field "{name}"; the schema is {schema}')
    value = record[name]
    if isinstance(value, int) and kind is str and not isinstance(value, bool):
        value = str(value)  # some LaMP releases write numeric ids
    if not isinstance(value, kind):
        raise ValueError(f'{where}: field "{name}" must be {kind.__name__}, got {type(value).__name__}; '
                         f"the schema is {schema}")  # fmt: skip
    return value


def _read_json(path: Path):
    if not path.is_file():
        raise FileNotFoundError(f"LaMP file not found: {path}")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: invalid JSON ({e.msg} at line {e.lineno})") from None


def load_lamp2(questions: str | Path, outputs: str | Path | None = None) -> list[LampQuestion]:
    """Read a LaMP-2 questions file (and its outputs file, for the gold tags); errors name the file and field."""
    questions = Path(questions)
    data = _read_json(questions)
    if not isinstance(data, list):
        raise ValueError(f"{questions}: expected {QUESTIONS_SCHEMA}, got a JSON {type(data).__name__}")
    items = []
    for index, record in enumerate(data):
        where = f"{questions}, question {index}"
        profile = _field(record, "profile", list, where, QUESTIONS_SCHEMA)
        entries = []
        for k, entry in enumerate(profile):
            at = f"{where}, profile item {k}"
            entries.append({name: _field(entry, name, str, at, QUESTIONS_SCHEMA) for name in PROFILE_FIELDS})
        qid = _field(record, "id", str, where, QUESTIONS_SCHEMA)
        items.append(LampQuestion(qid, _field(record, "input", str, where, QUESTIONS_SCHEMA), tuple(entries)))
    if outputs is None:
        return items
    outputs = Path(outputs)
    data = _read_json(outputs)
    task = _field(data, "task", str, str(outputs), OUTPUTS_SCHEMA)
    if not task.startswith("LaMP_2"):
        raise ValueError(f'{outputs}: field "task" is {task!r}; this loader reads LaMP_2 (movie tagging) only')
    golds = {}
    for index, record in enumerate(_field(data, "golds", list, str(outputs), OUTPUTS_SCHEMA)):
        where = f"{outputs}, gold {index}"
        golds[_field(record, "id", str, where, OUTPUTS_SCHEMA)] = _field(record, "output", str, where, OUTPUTS_SCHEMA)
    missing = [q.id for q in items if q.id not in golds]
    if missing:
        raise ValueError(f"{outputs}: no gold output for question ids {missing[:5]}; is it these questions' outputs?")
    return [LampQuestion(q.id, q.input, q.profile, golds[q.id]) for q in items]


def lamp2_metrics(predictions: list[str], golds: list[str], labels: tuple[str, ...] = LAMP2_TAGS) -> dict:
    """Official LaMP-2 accuracy and macro-F1 (see the module docstring)."""
    if len(predictions) != len(golds):
        raise ValueError(f"{len(predictions)} predictions for {len(golds)} golds")
    index = {label: i for i, label in enumerate(labels)}
    pred = [index.get(str(p).strip(), -1) for p in predictions]
    gold = [index.get(str(g).strip(), -1) for g in golds]
    f1 = []
    for k in range(len(labels)):
        tp = sum(p == k and g == k for p, g in zip(pred, gold))
        fp = sum(p == k and g != k for p, g in zip(pred, gold))
        fn = sum(p != k and g == k for p, g in zip(pred, gold))
        f1.append(2 * tp / (2 * tp + fp + fn) if tp + fp + fn else 0.0)
    accuracy = sum(p == g for p, g in zip(pred, gold)) / len(gold) if gold else 0.0
    return {"accuracy": accuracy, "f1": sum(f1) / len(f1)}
