"""The options `pact generate` and `pact chat` have whichever engine decodes, in a module that imports nothing heavy:
the llama.cpp engine's quick path (`llama_quick.py`) reads them without importing transformers, and the full parser
(`generation.GenerateArguments`, by `HfArgumentParser`) is built from the same dataclass."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import typing
from dataclasses import dataclass, field

ENGINES = ("pact", "llama.cpp")


@dataclass
class EngineArguments:
    model: str | None = field(
        default=None, metadata={"help": "Base model folder, Hub id or named model (default: SmolLM2)."}
    )
    adapter: list[str] = field(
        default_factory=list,
        metadata={
            "help": "Adapter folder, or NAME=FOLDER; repeat the flag to load several people's adapters on one base.",
            "action": "append",
        },
    )
    use: str | None = field(default=None, metadata={"help": "The adapter NAME to generate with (default: the first)."})
    max_new_tokens: int = field(
        default=256,
        metadata={"help": "Tokens to generate at most; generation stops at the end of sequence before that."},
    )
    temperature: float = field(default=0.0, metadata={"help": "0: greedy; above 0: sampling at this temperature."})
    top_p: float = field(default=1.0, metadata={"help": "Sampling: nucleus probability mass."})
    engine: str = field(
        default="pact",
        metadata={"help": "What decodes: pact (the NVFP4 base + the adapter, on --backend), or llama.cpp (the adapter "
                  "merged and exported once to a GGUF beside it; needs the llama extra).", "choices": list(ENGINES)},
    )  # fmt: skip


class _RaisingParser(argparse.ArgumentParser):
    def error(self, message: str):
        raise ValueError(message)


def light_parser(command: str) -> argparse.ArgumentParser:
    """An argparse parser of `EngineArguments` alone (and the prompt of `pact generate`), spelled as HfArgumentParser
    spells them (`--max_new_tokens` and `--max-new-tokens`); it raises ValueError where argparse would exit."""
    parser = _RaisingParser(prog=f"pact {command}", add_help=False, allow_abbrev=False, exit_on_error=False)
    hints = typing.get_type_hints(EngineArguments)  # not Field.type, which HfArgumentParser rewrites in place
    for option in dataclasses.fields(EngineArguments):
        flags = [f"--{option.name}"] + ([f"--{option.name.replace('_', '-')}"] if "_" in option.name else [])
        default = option.default_factory() if option.default_factory is not dataclasses.MISSING else option.default
        extra = {"choices": option.metadata["choices"]} if "choices" in option.metadata else {}
        action = option.metadata.get("action", "store")
        parser.add_argument(
            *flags,
            type=hints[option.name] if hints[option.name] in (int, float) else str,
            default=default,
            action=action,
            dest=option.name,
            **extra,
        )
    if command == "generate":
        parser.add_argument("prompt")
    return parser


def adapter_folders(values: list[str]) -> dict[str, str]:
    """`--adapter` values (FOLDER or NAME=FOLDER, repeated) as {name: folder}; the first unnamed one is "default"."""
    adapters = {}
    for i, value in enumerate(values):
        name, sep, folder = value.partition("=")
        name, folder = (name, folder) if sep else ("default" if i == 0 else f"adapter{i}", value)
        if name in adapters:
            raise ValueError(f"--adapter {value!r}: the name {name!r} is used twice; give each adapter its own NAME=")
        adapters[name] = folder
    return adapters


def check_context(prompt_tokens: int, max_new_tokens: int, context: int | None) -> None:
    if context is not None and prompt_tokens + max_new_tokens > context:
        raise ValueError(
            f"the prompt ({prompt_tokens} tokens) plus --max_new_tokens {max_new_tokens} exceeds the model's "
            f"{context}-token context; shorten the prompt or lower --max_new_tokens (in chat: /reset)."
        )


def converse(lines, answer, out) -> list[dict]:
    """The chat loop: each line of `lines` a user turn answered by `answer(messages) -> reply`; `/reset` forgets,
    `/quit` (or `/exit`) ends. Returns the conversation."""
    messages: list[dict] = []
    for line in lines:
        text = line.strip()
        if text in ("/quit", "/exit"):
            break
        if text == "/reset":
            messages.clear()
            print("(conversation reset)", file=out)
            continue
        if not text:
            continue
        messages.append({"role": "user", "content": text})
        messages.append({"role": "assistant", "content": answer(messages).strip()})
    return messages


def answer_or_chat(command: str, model, args, lines=None, out=None) -> int:
    """`pact generate` / `pact chat` on a quick path's `model` (`prompt_ids(messages)`, `answer(ids, args, out)`,
    `trained_on`, `has_template`): the answer, or the chat loop with the full path's note first; a ValueError is one
    line on stderr and status 2."""
    try:
        if command == "generate":
            model.answer(model.prompt_ids(args.prompt), args, out)
            return 0
        record = model.trained_on
        if record is not None and record.tags:
            print(f"note: {record.describe()}; each message is tagged on its own.", file=out)
        elif not model.has_template:
            print("note: this model has no chat template; turns are sent as plain text.", file=out)
        lines = lines if lines is not None else stdin_lines()
        converse(lines, lambda messages: model.answer(model.prompt_ids(messages), args, out), out)
        return 0
    except ValueError as err:
        print(f"pact {command}: error: {err}", file=sys.stderr)
        return 2


def stdin_lines():
    """What the person types, a `> ` prompt before each line, until end of input."""
    while True:
        try:
            yield input("> ")
        except EOFError:
            print()  # the prompt's line ends
            return


__all__ = ["ENGINES", "EngineArguments", "adapter_folders", "answer_or_chat", "check_context", "converse"]
__all__ += ["light_parser", "stdin_lines"]
