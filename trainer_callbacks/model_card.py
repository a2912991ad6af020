"""A Hub model card (README.md) for a PACT adapter folder: base model, PACT settings and measured metrics."""

from __future__ import annotations

import json
import re
from pathlib import Path

HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")


def _cell(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (list, tuple, set)):
        return ", ".join(str(v) for v in sorted(value, key=str))
    return str(value).replace("|", "\\|").replace("\n", " ")


def _table(rows: dict) -> list[str]:
    return ["| | |", "| --- | --- |"] + [f"| {key} | {_cell(value)} |" for key, value in rows.items()]


def write_model_card(
    adapter_dir: str | Path,
    base_model: str,
    settings: dict,
    metrics: dict,
    base_model_note: str | None = None,
    title: str | None = None,
) -> Path:
    """Write `adapter_dir/README.md` (replacing peft's template) and return its path.

    `base_model` is a Hub id (then also in the card's metadata, so the Hub links the base) or a local folder (only
    its name is written).
    `settings` (LoRA and PACT fields, training options) and `metrics` (measured figures) become tables. The folder
    is expected to hold a plain PEFT adapter; the card shows how to load it with stock peft.
    """
    adapter_dir = Path(adapter_dir)
    on_hub = bool(HUB_ID.match(base_model)) and not Path(base_model).expanduser().exists()
    if not on_hub:  # a local folder: its name only (a full path may name the user)
        base_model = Path(base_model).expanduser().resolve().name
        base_model_note = "a local model folder" + (f"; {base_model_note}" if base_model_note else "")
    front = ["---", "library_name: peft"]
    if on_hub:
        front.append(f"base_model: {base_model}")
    front += ["pipeline_tag: text-generation", "tags:", "- lora", "- peft", "- optimum-pact", "- nvfp4", "---"]
    load_base = base_model if on_hub else "path/to/base-model"
    lines = front + [
        "",
        f"# {title or 'LoRA adapter trained on-device with optimum-pact'}",
        "",
        "A plain PEFT LoRA adapter, trained with optimum-pact over an NVFP4 "
        "frozen base (PACT). `pact_config.json` holds the PACT settings; stock peft ignores it.",
        "",
        "## Base model",
        "",
        f"`{base_model}`" + (f" ({base_model_note})" if base_model_note else ""),
        "",
        "## Use",
        "",
        "```python",
        "from peft import PeftModel",
        "from transformers import AutoModelForCausalLM",
        "",
        f'base = AutoModelForCausalLM.from_pretrained("{load_base}")',
        'model = PeftModel.from_pretrained(base, "<this repo or folder>")',
        "```",
        "",
        "## PACT settings",
        "",
        *_table(settings),
        "",
        "## Measured metrics",
        "",
        *_table(metrics),
        "",
        "<details><summary>settings and metrics as JSON</summary>",
        "",
        "```json",
        json.dumps({"settings": settings, "metrics": metrics}, indent=2, sort_keys=True, default=str),
        "```",
        "",
        "</details>",
        "",
    ]
    path = adapter_dir / "README.md"
    path.write_text("\n".join(lines))
    return path
