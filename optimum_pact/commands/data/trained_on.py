"""What an adapter was trained on, kept beside it (`pact_data.json`) so that using it formats input the same way.

A tagging adapter learned `Note: {text}\\nTag: {label}<eos>`: `pact generate` and `pact chat` wrap what you type in
the same prompt and stop where training stopped. A chat adapter learned turns rendered with the model's chat
template (and the system message its conversations shared, if they shared one); prompt/completion and plain-text
adapters continue the text as given.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from . import PROMPT_TEMPLATE, format_example

DATA_RECORD_NAME = "pact_data.json"


@dataclass
class TrainedOn:
    """The data format an adapter learned, and for labelled data its prompt template and labels."""

    format: str  # labelled, chat, prompt_completion or text
    prompt_template: str | None = None  # labelled: the prompt, with {text} where the item goes
    labels: list[str] = field(default_factory=list)  # labelled: the answers it learned, each ended by EOS
    system: str | None = None  # chat: the system message every training conversation began with, if one

    @classmethod
    def of(cls, form: str, items: list[dict]) -> TrainedOn:
        """The record of a run on `items` in format `form` (what `load_data` returns)."""
        if form == "labelled":
            return cls(form, PROMPT_TEMPLATE, sorted({item["label"] for item in items}))
        if form == "chat":
            firsts = {m["messages"][0]["content"] for m in items if m["messages"][0]["role"] == "system"}
            shared = len(firsts) == 1 and all(m["messages"][0]["role"] == "system" for m in items)
            return cls(form, system=firsts.pop() if shared else None)
        return cls(form)

    def save(self, folder: str | Path) -> None:
        Path(folder, DATA_RECORD_NAME).write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, folder: str | Path) -> TrainedOn | None:
        """The record in `folder`, or None for an adapter trained elsewhere (it then continues text as given)."""
        path = Path(folder, DATA_RECORD_NAME)
        if not path.is_file():
            return None
        try:
            values = json.loads(path.read_text())
            return cls(**values)
        except (ValueError, TypeError) as err:
            raise ValueError(f"{path} is damaged ({err}); train the adapter again or delete that file") from None

    @property
    def tags(self) -> bool:
        return self.format == "labelled"

    def prompt(self, text: str) -> str:
        """A labelled adapter's prompt around `text` (the item as the user typed it)."""
        return self.prompt_template.format(text=text.strip())

    def answers(self) -> list[str]:
        """A tagging adapter's targets as training learned them (each tag after the prompt, before EOS)."""
        return [format_example("", label)[1] for label in self.labels]

    def describe(self) -> str:
        if self.tags:
            shown = ", ".join(self.labels[:8]) + (", ..." if len(self.labels) > 8 else "")
            return f"this adapter tags notes: each message gets one of its {len(self.labels)} tags ({shown})"
        return f"this adapter was trained on {self.format.replace('_', '/')} data"


def longest_answer_tokens(record: TrainedOn | None, count: Callable[[str], int]) -> int | None:
    """A tagging adapter's longest answer in tokens, its end of sequence included (`count(text)`: the engine's token
    count of a text without special tokens); None where there is no such bound."""
    if record is None or not record.tags:
        return None
    return 1 + max(count(answer) for answer in record.answers())


def prompt_input(record: TrainedOn | None, messages: list[dict] | str, has_template: bool) -> str | list[dict]:
    """What an adapter that learned `record` is prompted with, for any tokenizer: text to tokenize as is (a tagging
    adapter's prompt around the text, in a chat around the last message alone; plain text; turns joined where the
    model has no chat template), or the turns for the chat template (with the training conversations' system message
    when they shared one)."""
    if record is not None and record.tags:
        return record.prompt(messages if isinstance(messages, str) else messages[-1]["content"])
    if isinstance(messages, str):
        if record is None or record.format != "chat":
            return messages
        messages = [{"role": "user", "content": messages}]
    if record is not None and record.system is not None and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": record.system}, *messages]
    return messages if has_template else "\n".join(m["content"] for m in messages)


__all__ = ["DATA_RECORD_NAME", "TrainedOn", "longest_answer_tokens", "prompt_input"]
