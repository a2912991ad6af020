"""`pact generate` and `pact chat` on the pact engine once the base is packed in PACT's cache: torch, tokenizers and
the packed weights alone, without importing transformers or peft (issue 50: an answer in about 2 s, not 7-8).

The adapter's small files say what the full path would build: `adapter_config.json` (a plain LoRA), `pact_config.json`
(the dtype its frozen weights were built from, its 16-bit linears: which packed folder), `pact_data.json` (a tagging
adapter's prompt and tags). `PackedDecoder` computes the full path's logits bit for bit, so the answer is the one
`generation.py` prints. Where this path does not apply (sampling, several adapters, --backend or --dtype, a prompt
that needs the chat template, a LoRA variant, a base not packed yet or not a Llama / Qwen2), `quick_run` returns None
before printing anything and the full path runs, packing the base for the next call.
"""

from __future__ import annotations

import datetime
import json
import sys
from pathlib import Path

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from safetensors import SafetensorError
from safetensors.torch import load_file
from tokenizers import Tokenizer

from ..decoder import PackedDecoder
from ..files import read_json_object
from ..precision import resolve_dtype
from ..precision.plan import sixteen_bit_modules
from .data.trained_on import TrainedOn, longest_answer_tokens, prompt_input
from .generate_options import adapter_folders, answer_or_chat, check_context, light_parser
from .llama_quick import known_base
from .packed_cache import packed_folder
from .rounded_base import base_codes_file

# adapter_config.json fields whose non-default value is a LoRA this path does not run (peft's own layers would)
_PLAIN_LORA = {"peft_type": "LORA", "use_dora": False, "lora_bias": False, "bias": "none", "fan_in_fan_out": False}
_NONE = ("modules_to_save", "layer_replication", "trainable_token_indices", "target_parameters",
         "alora_invocation_tokens", "arrow_config", "use_bdlora")  # fmt: skip


def _json(path: Path) -> dict:
    """The JSON object in `path` ({} where there is no such file); a ValueError where it cannot be read: the full path
    reports it."""
    return read_json_object(path, "the full path reports it") if Path(path).is_file() else {}


def _lora_scaling(config: dict) -> float | None:
    """peft's scaling of a plain LoRA with this adapter_config.json (None: another kind this path leaves to peft)."""
    if any(config.get(key, value) != value for key, value in _PLAIN_LORA.items()):
        return None
    if any(config.get(key) for key in (*_NONE, "rank_pattern", "alpha_pattern", "use_qalora")):
        return None
    r, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(r, int) or r <= 0 or not isinstance(alpha, (int, float)):
        return None
    return alpha / r**0.5 if config.get("use_rslora") else alpha / r


class QuickPactModel:
    """The packed base plus one adapter (or none), prompting and stopping as `PactModelForCausalLM` does."""

    def __init__(self, decoder, tokenizer, base: str, trained_on: TrainedOn | None, tokenizer_config: dict):
        self.decoder, self.tokenizer, self.trained_on = decoder, tokenizer, trained_on
        self.template, self.special = chat_template(base, tokenizer_config)
        self.has_template = self.template is not None
        eos = _json(Path(base, "generation_config.json")).get("eos_token_id")
        eos = decoder.config.get("eos_token_id") if eos is None else eos
        self.eos = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        self.context = decoder.config.get("max_position_embeddings")

    def prompt_ids(self, messages: list[dict] | str) -> list[int]:
        """`modeling.prompt_ids`'s tokens: the text tokenized as is, or the turns rendered with the chat template as
        transformers' `apply_chat_template` renders them (a ValueError where this template does not render them)."""
        prompt = prompt_input(self.trained_on, messages, self.has_template)
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt).ids
        try:
            text = self.template.render(messages=prompt, tools=None, documents=None, add_generation_prompt=True,
                                        **self.special)  # fmt: skip
        except Exception as err:  # noqa: BLE001 - whatever a template raises
            why = f"the chat template did not render this conversation ({err}); run with --backend torch"
            raise ValueError(why) from err
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def answer(self, ids: list[int], args, out) -> str:
        """Greedy decoding after `ids`, printed as it comes (a tag without its leading space), then a newline."""
        check_context(len(ids), args.max_new_tokens, self.context)
        encode = self.tokenizer.encode
        bound = longest_answer_tokens(self.trained_on, lambda text: len(encode(text, add_special_tokens=False).ids))
        limit = args.max_new_tokens if bound is None else min(bound, args.max_new_tokens)
        new: list[int] = []
        shown = [""]

        def show(token: int) -> None:
            new.append(token)
            text = self.tokenizer.decode(new, skip_special_tokens=True).lstrip()
            if text.endswith("\ufffd"):
                return  # a character split over tokens: printed with the next one
            print(text[len(shown[0]) :], end="", file=out, flush=True)
            shown[0] = text

        self.decoder.greedy(ids, limit, self.eos, show)
        print(file=out, flush=True)
        return self.tokenizer.decode(new, skip_special_tokens=True)


def load_quick(args) -> QuickPactModel | None:
    """The quick model for parsed light options `args`, or None where the full path must answer."""
    adapters = adapter_folders(args.adapter)
    if args.engine != "pact" or args.temperature or len(adapters) > 1 or (args.use and args.use not in adapters):
        return None
    folder = next(iter(adapters.values()), None)
    base = known_base(args.model, folder)
    if base is None or not Path(base, "tokenizer.json").is_file():
        return None
    scaling, sixteen, dtype_name, trained_on = None, [], None, None
    if folder is not None:
        try:
            config = read_json_object(Path(folder, "adapter_config.json"), "the full path reports it")
            pact = _json(Path(folder, "pact_config.json"))
            trained_on = TrainedOn.load(folder)
        except ValueError:
            return None  # missing or damaged: the full path says what is wrong
        scaling = _lora_scaling(config)
        if scaling is None:
            return None
        sixteen = sixteen_bit_modules(pact.get("precision_plan"), pact.get("protected_modules"))
        dtype_name = pact.get("base_dtype")
    return _build(base, folder, scaling, sixteen, dtype_name, trained_on)


def _tokenizer_as_saved(config: dict) -> bool:
    """Whether transformers tokenizes with tokenizer.json as saved: a tokenizer_config.json that sets add_bos_token,
    add_eos_token or add_prefix_space has transformers rebuild its pre- or post-processor, which `tokenizers` alone
    would not (those bases take the full path)."""
    return all(config.get(key) is None for key in ("add_bos_token", "add_eos_token", "add_prefix_space"))


def _build(base, folder, scaling, sixteen, dtype_name, trained_on) -> QuickPactModel | None:
    dtype = resolve_dtype(dtype_name or "auto", inference=True)
    packed = packed_folder(base, dtype, sixteen, base_codes_file(folder))  # the adapter's own base, if it has one
    if packed is None:
        return None
    try:
        tokenizer_config = _json(Path(base, "tokenizer_config.json"))
        if not _tokenizer_as_saved(tokenizer_config):
            return None
        decoder = PackedDecoder.from_folder(packed)  # OSError: not packed yet; ValueError: an architecture it lacks
        if folder is not None:
            decoder.add_lora(load_file(str(Path(folder, "adapter_model.safetensors"))), scaling)
        tokenizer = Tokenizer.from_file(str(Path(base, "tokenizer.json")))
        return QuickPactModel(decoder, tokenizer, base, trained_on, tokenizer_config)
    except (OSError, ValueError, TypeError, SafetensorError):
        return None  # the full path says what is wrong


SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def chat_template(base: str, config: dict):
    """The base's chat template compiled as transformers compiles it (a sandboxed jinja2 environment with
    trim_blocks, lstrip_blocks, loop controls and its `tojson`, `raise_exception` and `strftime_now`), and the
    special tokens `apply_chat_template` passes it (`config`: its tokenizer_config.json); (None, {}) where the base
    has none. A template this cannot compile (one using transformers' `{% generation %}` tag) is a ValueError: the full
    path renders it."""
    source = Path(base, "chat_template.jinja")
    source = source.read_text() if source.is_file() else config.get("chat_template")
    if not source:
        return None, {}
    if not isinstance(source, str):
        raise ValueError("several named chat templates")
    if tuple(int(part) for part in jinja2.__version__.split(".")[:3] if part.isdigit()) < (3, 1, 6):
        raise ValueError("jinja2 < 3.1.6 has known sandbox escapes")  # transformers refuses it too

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda f: datetime.datetime.now().strftime(f))
    try:
        template = env.from_string(source)
    except jinja2.exceptions.TemplateError as err:
        raise ValueError(f"the chat template does not compile here: {err}") from err
    special = {}
    for name in SPECIAL_TOKENS:
        value = config.get(name)
        value = value.get("content") if isinstance(value, dict) else value
        if value is not None:
            special[name] = value
    return template, special


def quick_run(command: str, argv: list[str], lines=None, out=None) -> int | None:
    """Run `pact generate` / `pact chat` with `argv` on the quick model; None where this path does not apply."""
    try:
        args = light_parser(command).parse_args(argv)
        model = load_quick(args)
        if model is not None:  # a prompt (or a chat template) this path cannot render goes to the full path
            model.prompt_ids(args.prompt if command == "generate" else [{"role": "user", "content": "hi"}])
    except ValueError:
        return None  # an option only the full path takes, or a mistake the full path reports
    if model is None:
        return None
    return answer_or_chat(command, model, args, lines, sys.stdout if out is None else out)


__all__ = ["QuickPactModel", "chat_template", "load_quick", "quick_run"]
