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

from transformers import HfArgumentParser, TextStreamer

from peft_ext.options import PactOptions, derived_options

from ..precision import DTYPES
from .llama_engine import ENGINES, LlamaCppModel, llama_cpp_model
from .modeling import PactModelForCausalLM


@dataclass
class _GenerateOwn:
    model: str | None = field(default=None, metadata={"help": "Base model folder or Hub id (default: SmolLM2)."})
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
    dtype: str = field(
        default="auto",
        metadata={"help": "Compute dtype; auto: bfloat16 (the frozen weights stay NVFP4 either way).",
                  "choices": list(DTYPES)},
    )  # fmt: skip
    engine: str = field(
        default="pact",
        metadata={"help": "What decodes: pact (the NVFP4 base + the adapter, on --backend), or llama.cpp (the adapter "
                  "merged and exported once to a GGUF beside it; needs the llama extra).", "choices": list(ENGINES)},
    )  # fmt: skip


BackendArguments = derived_options("BackendArguments", PactOptions, ("backend", "backend_options"))


@dataclass
class GenerateArguments(_GenerateOwn, BackendArguments):
    """`pact generate` / `pact chat` options: their own, and PactOptions' backend ones."""


def _adapters(values: list[str]) -> dict[str, str]:
    adapters = {}
    for i, value in enumerate(values):
        name, sep, folder = value.partition("=")
        name, folder = (name, folder) if sep else ("default" if i == 0 else f"adapter{i}", value)
        if name in adapters:
            raise ValueError(f"--adapter {value!r}: the name {name!r} is used twice; give each adapter its own NAME=")
        adapters[name] = folder
    return adapters


def load(args, say=None) -> PactModelForCausalLM | LlamaCppModel:
    """The model `args` ask for: on llama.cpp with `--engine llama.cpp` where it can run (else one note through
    `say`, stderr by default, and PACT's), else on PACT's NVFP4 base."""
    if getattr(args, "engine", "pact") == "llama.cpp":
        say = say or (lambda line: print(line, file=sys.stderr, flush=True))
        model = llama_cpp_model(args.model, _adapters(args.adapter), say)
        if model is not None:
            if args.use is not None:
                model.set_adapter(args.use)
            return model
    options = PactOptions(backend=args.backend, backend_options=args.backend_options)  # checked once, there
    model = PactModelForCausalLM.from_pretrained(
        args.model, _adapters(args.adapter), options.backend, options.backend_options, args.dtype
    )
    if args.use is not None:
        model.set_adapter(args.use)
    return model


def _generate(model: PactModelForCausalLM | LlamaCppModel, ids, args) -> str:
    context = model.context_length()
    if context is not None and ids.shape[1] + args.max_new_tokens > context:
        raise ValueError(
            f"the prompt ({ids.shape[1]} tokens) plus --max_new_tokens {args.max_new_tokens} exceeds the model's "
            f"{context}-token context; shorten the prompt or lower --max_new_tokens (in chat: /reset)."
        )
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
    if isinstance(model, LlamaCppModel):
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
    messages: list[dict] = []
    try:
        _converse(model, args, messages, lines if lines is not None else _stdin(), out)
    finally:
        _close(model)
    return messages


def _converse(model, args, messages: list[dict], lines, out) -> None:
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
        reply = _generate(model, model.prompt_ids(messages), args)
        messages.append({"role": "assistant", "content": reply.strip()})


def _stdin():
    while True:
        try:
            yield input("> ")
        except EOFError:
            print()  # the prompt's line ends
            return


__all__ = ["GenerateArguments", "parse", "run_chat", "run_generate"]
