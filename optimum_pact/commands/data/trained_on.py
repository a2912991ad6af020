"""What an adapter was trained on, kept beside it (`pact_data.json`) so that using it formats input the same way.

A tagging adapter learned `Note: {text}\\nTag: {label}<eos>`: `pact generate` and `pact chat` wrap what you type in
the same prompt and stop where training stopped. A chat adapter learned turns rendered with the model's chat
template (and the system message its conversations shared, if they shared one); prompt/completion and plain-text
adapters continue the text as given.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from . import PROMPT_TEMPLATE

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

    def describe(self) -> str:
        if self.tags:
            shown = ", ".join(self.labels[:8]) + (", ..." if len(self.labels) > 8 else "")
            return f"this adapter tags notes: each message gets one of its {len(self.labels)} tags ({shown})"
        return f"this adapter was trained on {self.format.replace('_', '/')} data"


__all__ = ["DATA_RECORD_NAME", "TrainedOn"]
