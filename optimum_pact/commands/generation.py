"""`pact generate` and `pact chat`: use the adapters you trained, on the same NVFP4 base and backends.

    pact generate --adapter pact-output/adapter "Leo lost another tooth"        # a tagging adapter answers a tag
    pact generate --adapter sam=runs/sam --adapter jo=runs/jo --use jo "..."   # several people, one base
    pact chat --adapter my-run/adapter                                         # /reset, /quit
    pact chat --adapter my-run/adapter --engine llama.cpp                      # llama.cpp decodes (llama_engine.py)

Tokens are printed as they come. Options are `GenerateArguments` (parsed by `HfArgumentParser`); the backend
options are `PactOptions`' own fields.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from transformers import HfArgumentParser, TextStreamer

from peft_ext.options import PactOptions, derived_options

from ..precision import DTYPES
from .generate_options import EngineArguments, adapter_folders, check_context, converse, stdin_lines
from .modeling import PactModelForCausalLM

if TYPE_CHECKING:
    from .llama_engine import LlamaCppModel


@dataclass
class _PactEngineOwn:
    dtype: str = field(
        default="auto",
        metadata={"help": "Compute dtype; auto: bfloat16 (the frozen weights stay NVFP4 either way).",
                  "choices": list(DTYPES)},
    )  # fmt: skip


BackendArguments = derived_options("BackendArguments", PactOptions, ("backend", "backend_options"))


@dataclass
class GenerateArguments(EngineArguments, _PactEngineOwn, BackendArguments):
    """`pact generate` / `pact chat` options: both engines' (`generate_options.py`), and the pact engine's dtype and
    PactOptions' backend ones."""


def load(args, say=None) -> PactModelForCausalLM | LlamaCppModel:
    """The model `args` ask for: on llama.cpp with `--engine llama.cpp` where it can run (else one note through
    `say`, stderr by default, and PACT's), else on PACT's NVFP4 base."""
    if getattr(args, "engine", "pact") == "llama.cpp":
        say = say or (lambda line: print(line, file=sys.stderr, flush=True))
        from .llama_engine import llama_cpp_model  # imported where used: it brings the exporters

        model = llama_cpp_model(args.model, adapter_folders(args.adapter), say)
        if model is not None:
            if args.use is not None:
                model.set_adapter(args.use)
            return model
    options = PactOptions(backend=args.backend, backend_options=args.backend_options)  # checked once, there
    model = PactModelForCausalLM.from_pretrained(
        args.model, adapter_folders(args.adapter), options.backend, options.backend_options, args.dtype
    )
    if args.use is not None:
        model.set_adapter(args.use)
    return model


def _generate(model: PactModelForCausalLM | LlamaCppModel, ids, args) -> str:
    check_context(ids.shape[1], args.max_new_tokens, model.context_length())
    answer = model.max_answer_tokens()  # a tagging adapter answers one label and its end of sequence
    max_new_tokens = args.max_new_tokens if answer is None else min(answer, args.max_new_tokens)
    sampling = {"do_sample": True, "temperature": args.temperature, "top_p": args.top_p} if args.temperature else {}
    sampling.setdefault("do_sample", False)
    streamer = AnswerStreamer(model.tokenizer, skip_prompt=True, skip_special_tokens=True)
    out = model.generate(input_ids=ids, max_new_tokens=max_new_tokens, streamer=streamer, **sampling)
    return model.tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


class AnswerStreamer(TextStreamer):
    """transformers' TextStreamer without the answer's leading space (a tag is learned as " kin": it prints kin)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.started = False

    def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
        if not self.started:
            text = text.lstrip()
            self.started = bool(text)
        super().on_finalized_text(text, stream_end)


def parse(argv: list[str], command: str) -> tuple:
    """(GenerateArguments, prompt or None) from a `pact generate` / `pact chat` command line."""
    parser = HfArgumentParser(GenerateArguments, prog=f"pact {command}")
    # HfArgumentParser gives a list field nargs="+", so `--adapter DIR "prompt"` would swallow the prompt: one value
    # per --adapter, repeated (tests/test_generation.py fails loudly if HfArgumentParser changes this action)
    next(action for action in parser._actions if action.dest == "adapter").nargs = None
    if command == "generate":
        parser.add_argument("prompt", help="The text to continue (in quotes).")
    parsed = parser.parse_args_into_dataclasses(argv)
    return parsed[0], (parsed[1].prompt if command == "generate" else None)


def run_generate(args, prompt: str) -> str:
    model = load(args)
    try:
        return _generate(model, model.prompt_ids(prompt), args)
    finally:
        _close(model)


def _close(model) -> None:
    if not isinstance(model, PactModelForCausalLM):  # llama.cpp's
        model.close()  # before the interpreter's shutdown, where llama-cpp-python's own cleanup fails


def run_chat(args, lines=None, out=None) -> list[dict]:
    """Read user turns from `lines` (stdin), answer each with the chat template; `/reset` forgets, `/quit` ends."""
    out = sys.stdout if out is None else out
    model = load(args)
    record = model.active_trained_on
    if record is not None and record.tags:
        print(f"note: {record.describe()}; each message is tagged on its own.", file=out)
    elif not getattr(model.tokenizer, "chat_template", None):
        print("note: this model has no chat template; turns are sent as plain text.", file=out)
    try:
        return converse(
            lines if lines is not None else stdin_lines(),
            lambda messages: _generate(model, model.prompt_ids(messages), args),
            out,
        )
    finally:
        _close(model)


__all__ = ["GenerateArguments", "parse", "run_chat", "run_generate"]
