"""`pact generate --engine llama.cpp` and `pact chat --engine llama.cpp` once the adapter's GGUF is cached: llama.cpp
alone, without importing torch, transformers or peft (a second or so of wall time, not ten).

The GGUF holds what the answer needs: the weights, the tokenizer and the chat template; the adapter's small files
say how it was trained (`pact_data.json`: a tagging adapter's prompt and tags). Where this path cannot answer (other
options, a GGUF not exported yet or exported from another adapter, llama-cpp-python missing), `quick_run` returns None
and the full path (`llama_engine.py`, `generation.py`) runs, which exports the GGUF and reports any error.
"""

from __future__ import annotations

import codecs
import importlib.util
import json
import os
import re
import sys
from pathlib import Path

from ..cache import cache_dir
from ..files import sha256_file
from .data.trained_on import TrainedOn, longest_answer_tokens, prompt_input
from .default_model import recorded_base
from .generate_options import adapter_folders, answer_or_chat, check_context, light_parser
from .named_models import SMOLLM2, named_model

GGUF_NAME = "pact-model.gguf"
RECORD_NAME = "pact-model.json"
# raise when the GGUF written for the same adapter changes (2: GPTQ merge, 16-bit linears; 3: the merge's size budget)
WRITER_VERSION = 3
MAX_CONTEXT = 4096  # llama.cpp's KV cache is allocated whole: no more than this many tokens


def record_key(folder: Path, base: str) -> dict:
    """What a cached GGUF was exported from: the adapter's weights, the base (`resolve_model`'s answer) and the
    writer's version."""
    weights = Path(folder) / "adapter_model.safetensors"
    return {"adapter_sha256": sha256_file(weights), "base": base, "writer": WRITER_VERSION}


def current_gguf(folder: str | Path, base: str) -> tuple[Path, dict] | None:
    """The GGUF cached beside the adapter in `folder` and its record (`record_key`'s, and the `context` llama.cpp is
    given) if it was exported from this adapter and `base`, else None."""
    out, record = Path(folder) / GGUF_NAME, Path(folder) / RECORD_NAME
    try:
        if out.is_file() and (Path(folder) / "adapter_model.safetensors").is_file():
            values = json.loads(record.read_text())
            key = record_key(Path(folder), base)
            if {name: values.get(name) for name in key} == key and isinstance(values.get("context"), int):
                return out, values
    except (OSError, ValueError, AttributeError):
        pass  # no record, or a damaged one
    return None


def known_base(model: str | None, adapter: str | None = None) -> str | None:
    """`resolve_model(model, adapter)`'s answer where it needs no check that only the full path can make, else
    None."""
    model = model if model is not None else recorded_base(adapter)
    path = Path(model).expanduser() if model is not None else None
    if path is not None and path.exists():
        return str(path)  # checked by the full path when the GGUF's record was written
    named = SMOLLM2 if model is None else named_model(model)
    if named is not None:
        folder = cache_dir() / named.folder
        return str(folder) if (folder / "config.json").is_file() else None
    return model if re.fullmatch(r"[\w.-]+/[\w.-]+", model) else None


def threads() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


class QuickModel:
    """An adapter's cached GGUF in llama.cpp, prompting as the adapter was trained (`modeling.prompt_ids`)."""

    def __init__(self, path: Path, trained_on: TrainedOn | None, context: int):
        from llama_cpp import Llama, llama_vocab_is_eog

        self.llm = Llama(model_path=str(path), n_ctx=context, n_threads=threads(), verbose=False)
        self.trained_on, self.context = trained_on, context
        self.add_bos = self.llm.metadata.get("tokenizer.ggml.add_bos_token") == "true"
        self.template = self.llm.metadata.get("tokenizer.chat_template")
        self.has_template = bool(self.template)
        vocab = getattr(getattr(self.llm, "_model", None), "vocab", None)
        eos = self.llm.token_eos()
        self.is_end = (lambda token: llama_vocab_is_eog(vocab, token)) if vocab is not None else eos.__eq__

    def tokens(self, text: str, add_bos: bool) -> list[int]:
        return self.llm.tokenize(text.encode(), add_bos=add_bos, special=True)

    def special_text(self, token: int) -> str:
        return self.llm.detokenize([token], special=True).decode(errors="replace") if token >= 0 else ""

    def prompt_ids(self, messages: list[dict] | str) -> list[int]:
        """As `modeling.prompt_ids` formats it (`prompt_input`), tokenized by the GGUF's own tokenizer."""
        prompt = prompt_input(self.trained_on, messages, bool(self.template))
        if isinstance(prompt, str):
            return self.tokens(prompt, self.add_bos)
        from llama_cpp.llama_chat_format import Jinja2ChatFormatter

        formatter = Jinja2ChatFormatter(
            self.template, self.special_text(self.llm.token_eos()), self.special_text(self.llm.token_bos())
        )
        return self.tokens(formatter(messages=prompt).prompt, add_bos=False)  # the template writes any BOS

    def max_answer_tokens(self) -> int | None:
        return longest_answer_tokens(self.trained_on, lambda text: len(self.tokens(text, False)))

    def answer(self, ids: list[int], args, out) -> str:
        """Decode after `ids` as `pact generate` does (greedy, or sampling), printing the text as it comes."""
        check_context(len(ids), args.max_new_tokens, self.context)
        bound = self.max_answer_tokens()
        limit = args.max_new_tokens if bound is None else min(bound, args.max_new_tokens)
        sampling = (
            {"temp": args.temperature, "top_p": args.top_p, "top_k": 0}
            if args.temperature
            else {"temp": 0.0, "top_k": 1}
        )
        decoder, new, shown, count = codecs.getincrementaldecoder("utf-8")(errors="replace"), [], "", 0
        if limit > 0:
            for token in self.llm.generate(ids, min_p=0.0, repeat_penalty=1.0, **sampling):
                count += 1  # the end of sequence counts, as in transformers' generate
                if self.is_end(token):
                    break
                new.append(token)
                text = decoder.decode(self.llm.detokenize([token]))
                text = text if shown else text.lstrip()  # a tag is learned as " kin": it prints kin
                shown += text
                print(text, end="", file=out, flush=True)
                if count >= limit:
                    break
        print(file=out, flush=True)
        return self.llm.detokenize(new).decode(errors="replace")

    def close(self) -> None:
        self.llm.close()


def quick_run(command: str, argv: list[str], lines=None, out=None) -> int | None:
    """Run `pact generate` / `pact chat` with `argv` on the cached GGUF; None where this path does not apply."""
    if "llama.cpp" not in argv or importlib.util.find_spec("llama_cpp") is None:
        return None
    try:
        args = light_parser(command).parse_args(argv)
        adapters = adapter_folders(args.adapter)
    except ValueError:
        return None  # an option only the full path takes, or a mistake the full path reports
    active = args.use if args.use is not None else next(iter(adapters), None)
    base = known_base(args.model, adapters.get(active))
    if args.engine != "llama.cpp" or base is None or active not in adapters:
        return None
    if not all(Path(folder, "adapter_config.json").is_file() for folder in adapters.values()):
        return None
    cached = current_gguf(adapters[active], base)
    try:
        trained_on = TrainedOn.load(adapters[active])
    except ValueError:
        return None
    if cached is None:
        return None
    model = QuickModel(cached[0], trained_on, cached[1]["context"])
    try:
        return answer_or_chat(command, model, args, lines, sys.stdout if out is None else out)
    finally:
        model.close()


__all__ = ["GGUF_NAME", "MAX_CONTEXT", "RECORD_NAME", "WRITER_VERSION"]
__all__ += ["current_gguf", "known_base", "quick_run", "record_key"]
