"""Generative training data in the formats mlx-lm and TRL users keep, and their tokenization with loss masks.

* `{"messages": [{"role": ..., "content": ...}, ...]}` (chat): rendered with the model's chat template; the loss
  sees the assistant turns only.
* `{"prompt": ..., "completion": ...}`: the loss sees the completion (and the end-of-sequence token) only.
* `{"text": ...}`: plain text, the person's own writing; the loss sees all of it.

The format is read from the first line; a line in another format is an error naming it. An optional `"split":
"train"|"test"` on every line picks the held-out items; without it about 20% are held out, deterministically.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

EXAMPLES = Path(__file__).parent / "examples"
GENERATIVE_FORMATS = ("chat", "prompt_completion", "text")
SHAPES = {
    "labelled": '{"text": ..., "label": ...}',
    "chat": '{"messages": [{"role": "user", "content": ...}, {"role": "assistant", "content": ...}]}',
    "prompt_completion": '{"prompt": ..., "completion": ...}',
    "text": '{"text": ...}',
}
ROLES = ("system", "user", "assistant")
HELDOUT_FRACTION = 0.2
SPLIT_SEED = 0
MAX_TOKENS = 1024  # longer items are cut here (the loss then sees their first MAX_TOKENS tokens)


def builtin_data(name: str) -> Path | None:
    """The packaged example file called `name` ("chat", "prompt_completion", "text"), or None."""
    path = EXAMPLES / f"{name}.jsonl"
    return path if name in GENERATIVE_FORMATS and path.is_file() else None


def record_format(record: dict) -> str | None:
    """The format a parsed line is in (one of `SHAPES`), or None."""
    keys = set(record) - {"split"}
    if "messages" in keys:
        return "chat"
    if {"prompt", "completion"} <= keys:
        return "prompt_completion"
    if {"text", "label"} <= keys:
        return "labelled"
    if "text" in keys:
        return "text"
    return None


def _read(path: Path, lineno: int, line: str) -> dict:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}, line {lineno}: invalid JSON ({err.msg}); each line is one JSON object") from None
    if not isinstance(record, dict) or record_format(record) is None:
        shapes = "; ".join(f"{name}: {shape}" for name, shape in SHAPES.items())
        raise ValueError(f"{path}, line {lineno}: not an item of a known format ({shapes})")
    return record


def file_format(path: str | Path) -> str:
    """The format of a JSONL data file, read from its first non-blank line."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"data file not found: {path} (JSON Lines; one of {', '.join(SHAPES.values())})")
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if line.strip():
                return record_format(_read(path, lineno, line))
    raise ValueError(f"{path}: no items; each line is one JSON object, e.g. {SHAPES['prompt_completion']}")


def _text(record: dict, key: str, where: str) -> str:
    value = record.get(key)
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f'{where}: "{key}" must be a non-empty string, got {value!r}')
    return value


def _item(record: dict, form: str, where: str) -> dict:
    if form == "prompt_completion":
        return {"prompt": _text(record, "prompt", where), "completion": _text(record, "completion", where)}
    if form == "text":
        return {"text": _text(record, "text", where)}
    messages = record["messages"]
    if not isinstance(messages, list) or not messages:
        raise ValueError(f'{where}: "messages" must be a non-empty list of {{"role", "content"}} objects')
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise ValueError(f"{where}: message {i} needs a role, one of {', '.join(ROLES)}; got {message!r}")
        _text(message, "content", f"{where}, message {i}")
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError(f"{where}: no assistant message, so nothing to learn; add the reply you want")
    return {"messages": [{"role": m["role"], "content": m["content"]} for m in messages]}


@dataclass
class GenerativeData:
    format: str  # one of GENERATIVE_FORMATS
    train: list[dict]
    heldout: list[dict]


def load_generative_dataset(path: str | Path) -> GenerativeData:
    """Read a chat, prompt/completion or plain-text JSONL file; see the module doc."""
    path = Path(path)
    form = file_format(path)
    if form not in GENERATIVE_FORMATS:
        raise ValueError(f"{path} holds labelled items; read it with load_personal_dataset")
    items, splits = [], []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            record, where = _read(path, lineno, line), f"{path}, line {lineno}"
            if record_format(record) != form:
                raise ValueError(
                    f"{where}: a {record_format(record)} item in a {form} file (the first line's format); "
                    "one file holds one format"
                )
            split = record.get("split")
            if split not in (None, "train", "test"):
                raise ValueError(f'{where}: "split" must be "train" or "test", got {split!r}')
            items.append(_item(record, form, where))
            splits.append((lineno, split))
    given = [split for _, split in splits if split is not None]
    if given and len(given) < len(splits):
        lineno = next(n for n, split in splits if split is None)
        raise ValueError(f'{path}, line {lineno}: no "split" field while other lines have one; give every line one')
    if given:
        heldout = {i for i, (_, split) in enumerate(splits) if split == "test"}
    else:
        count = max(1, round(HELDOUT_FRACTION * len(items))) if len(items) >= 2 else 0
        heldout = set(random.Random(SPLIT_SEED).sample(range(len(items)), count))
    train = [item for i, item in enumerate(items) if i not in heldout]
    test = [item for i, item in enumerate(items) if i in heldout]
    if not train or not test:
        raise ValueError(f'{path}: needs items to train on and to hold out (about 20% with "split": "test")')
    return GenerativeData(form, train, test)


def _chat_ids(tokenizer, messages: list[dict], generation_prompt: bool = False) -> list[int]:
    out = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=generation_prompt)
    return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)


def tokenize_generative(tokenizer, items: list[dict], form: str, max_tokens: int = MAX_TOKENS) -> list[dict]:
    """`input_ids`, `attention_mask` and `labels` (-100 where the loss does not look) for each item."""
    if form == "chat" and not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "chat data needs a model with a chat template; this tokenizer has none (use prompt/completion)"
        )
    rows = []
    for item in items:
        if form == "chat":
            ids, learn = _chat_tokens(tokenizer, item["messages"])
        elif form == "prompt_completion":
            prompt = tokenizer(item["prompt"])["input_ids"]
            completion = tokenizer(item["completion"], add_special_tokens=False)["input_ids"] + [
                tokenizer.eos_token_id
            ]
            ids, learn = prompt + completion, [False] * len(prompt) + [True] * len(completion)
        else:
            ids = tokenizer(item["text"])["input_ids"] + [tokenizer.eos_token_id]
            learn = [True] * len(ids)
        ids, learn = ids[:max_tokens], learn[:max_tokens]
        rows.append(
            {
                "input_ids": ids,
                "attention_mask": [1] * len(ids),
                "labels": [t if keep else -100 for t, keep in zip(ids, learn)],
            }
        )
    return rows


def _chat_tokens(tokenizer, messages: list[dict]) -> tuple[list[int], list[bool]]:
    """The conversation's tokens and which of them are assistant turns, from the template rendered turn by turn."""
    ids = _chat_ids(tokenizer, messages)
    learn = [False] * len(ids)
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start = len(_chat_ids(tokenizer, messages[:i], generation_prompt=True))
        end = len(_chat_ids(tokenizer, messages[: i + 1]))
        if _chat_ids(tokenizer, messages[: i + 1]) != ids[:end] or start > end:
            raise ValueError(
                "this chat template renders a conversation differently from its turns; use prompt/completion"
            )
        learn[start:end] = [True] * (end - start)
    return ids, learn


def prompt_ids(tokenizer, item: dict, form: str) -> list[int]:
    """The tokens a model answers after: the prompt, the chat up to its last assistant turn, or a text's first half."""
    if form == "prompt_completion":
        return tokenizer(item["prompt"])["input_ids"]
    if form == "chat":
        last = max(i for i, m in enumerate(item["messages"]) if m["role"] == "assistant")
        return _chat_ids(tokenizer, item["messages"][:last], generation_prompt=True)
    ids = tokenizer(item["text"])["input_ids"]
    return ids[: max(1, len(ids) // 2)]


__all__ = [
    "EXAMPLES",
    "builtin_data",
    "GENERATIVE_FORMATS",
    "GenerativeData",
    "file_format",
    "load_generative_dataset",
    "prompt_ids",
    "record_format",
    "tokenize_generative",
]
