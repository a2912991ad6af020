"""`pact generate --engine llama.cpp` and `pact chat --engine llama.cpp`: llama.cpp decodes the personal model.

Each adapter is exported once as `pact export --format gguf` exports it (merged into its NVFP4 base, without the
merge's scoring) to `pact-model.gguf` beside it, with `pact-model.json` recording the sha256 of
adapter_model.safetensors and the base: a retrained adapter is exported again on its next use. llama-cpp-python
decodes it; the prompt is formatted and tokenized by PACT exactly as with `--engine pact` (the adapter's
`pact_data.json`, the HF tokenizer and its chat template), and the tokens stream through the same streamer. With
several adapters, each one's GGUF is loaded when it is used.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import torch
from transformers import AutoConfig, GenerationConfig

from ..errors import OptionError
from .data.trained_on import TrainedOn
from .generate_options import ENGINES
from .gguf_export import check_architecture, export_gguf
from .llama_quick import GGUF_NAME, MAX_CONTEXT, RECORD_NAME, current_gguf, record_key, threads
from .model_folder import check_adapter_folder, load_tokenizer, resolve_model
from .modeling import max_answer_tokens, prompt_ids


def cached_gguf(adapter: str | Path, base: str | None = None) -> Path:
    """The GGUF of `adapter` merged into its base, beside the adapter: exported now unless the one there was
    exported from the same adapter_model.safetensors and base."""
    folder = check_adapter_folder(adapter)
    weights = folder / "adapter_model.safetensors"
    if not weights.is_file():
        raise FileNotFoundError(
            f"--adapter {str(folder)!r} holds no adapter_model.safetensors; --engine llama.cpp exports that file"
        )
    path = resolve_model(base, folder)
    if current_gguf(folder, path) is not None:
        return folder / GGUF_NAME
    key = record_key(folder, path) | {"context": context_size(AutoConfig.from_pretrained(path))}
    out, record = folder / GGUF_NAME, folder / RECORD_NAME
    out.unlink(missing_ok=True)
    record.unlink(missing_ok=True)
    print(f"[optimum-pact] exporting {folder} once for llama.cpp: {out}", file=sys.stderr, flush=True)
    try:
        export_gguf(folder, out, base, score=False)
    except OptionError:  # a base without full-precision weights: merge into its NVFP4 weights
        export_gguf(folder, out, base, score=False, requantize_from="nvfp4")
    record.write_text(json.dumps(key, indent=2) + "\n")
    return out


def context_size(config) -> int:
    """The context llama.cpp is given for a model of `config`: its own, at most MAX_CONTEXT tokens."""
    return min(config.max_position_embeddings, MAX_CONTEXT)


class LlamaCppModel:
    """What `pact generate` / `pact chat` use of a model (tokenizer, prompt formatting, `generate`), decoded by
    llama.cpp from each adapter's cached GGUF."""

    def __init__(self, base: str | None, adapters: dict[str, str], n_threads: int | None = None):
        self.base, self.path = base, resolve_model(base, next(iter(adapters.values()), None))
        config = AutoConfig.from_pretrained(self.path)
        check_architecture(config, self.path)
        self.tokenizer = load_tokenizer(self.path, base)
        self.folders = {name: str(check_adapter_folder(folder)) for name, folder in adapters.items()}
        self.trained_on = {name: TrainedOn.load(folder) for name, folder in self.folders.items()}
        self.active = next(iter(self.folders))
        self.n_ctx = context_size(config)
        self.n_threads = n_threads if n_threads is not None else threads()
        eos = GenerationConfig.from_pretrained(self.path).eos_token_id if self._has_generation_config() else None
        eos = self.tokenizer.eos_token_id if eos is None else eos
        self.eos = set(eos) if isinstance(eos, list) else {eos}
        self._llm, self._loaded = None, None

    def _has_generation_config(self) -> bool:
        return Path(self.path, "generation_config.json").is_file()

    @property
    def adapters(self) -> list[str]:
        return list(self.folders)

    def set_adapter(self, name: str) -> None:
        if name not in self.folders:
            raise ValueError(f"no adapter named {name!r}; loaded: {self.adapters}")
        self.active = name

    @property
    def active_trained_on(self) -> TrainedOn | None:
        return self.trained_on[self.active]

    def max_answer_tokens(self) -> int | None:
        return max_answer_tokens(self.tokenizer, self.active_trained_on)

    def prompt_ids(self, messages: list[dict] | str) -> torch.Tensor:
        return prompt_ids(self.tokenizer, self.active_trained_on, messages)

    def context_length(self) -> int:
        return self.n_ctx

    def llm(self):
        """The llama.cpp model of the active adapter (exported first if needed), loaded once while it is active."""
        if self._loaded != self.active:
            from llama_cpp import Llama

            path = cached_gguf(self.folders[self.active], self.base)
            self.close()
            self._llm = Llama(model_path=str(path), n_ctx=self.n_ctx, n_threads=self.n_threads, verbose=False)
            self._loaded = self.active
        return self._llm

    def close(self) -> None:
        if self._llm is not None:
            self._llm.close()
        self._llm, self._loaded = None, None

    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, streamer=None, do_sample: bool = False,
                 temperature: float = 1.0, top_p: float = 1.0, **_) -> torch.Tensor:  # fmt: skip
        """transformers' `generate` for what `pact generate` asks of it: `input_ids` [1, n], greedy or sampling at
        `temperature` / `top_p`, stopping at the end of sequence; returns the prompt and the new ids, [1, n + new]."""
        llm = self.llm()
        ids = input_ids[0].tolist()
        if streamer is not None:
            streamer.put(input_ids[0])  # as transformers does: the streamer skips the prompt
        sampling = {"temp": temperature, "top_p": top_p, "top_k": 0} if do_sample else {"temp": 0.0, "top_k": 1}
        new: list[int] = []
        if max_new_tokens > 0:
            for token in llm.generate(ids, min_p=0.0, repeat_penalty=1.0, **sampling):
                new.append(token)
                if streamer is not None:
                    streamer.put(torch.tensor([token]))
                if token in self.eos or len(new) >= max_new_tokens:
                    break
        if streamer is not None:
            streamer.end()
        return torch.tensor([ids + new])


def llama_cpp_model(base: str | None, adapters: dict[str, str], say) -> LlamaCppModel | None:
    """A `LlamaCppModel`, its first adapter exported and loaded; None, after one line through `say`, where llama.cpp
    cannot run it (no `llama` extra, no adapter, an architecture or tokenizer --format gguf does not write)."""
    instead = "decoding with --engine pact instead"
    if importlib.util.find_spec("llama_cpp") is None:
        say(f"note: --engine llama.cpp needs llama-cpp-python (pip install 'optimum-pact[llama]'); {instead}.")
        return None
    if not adapters:
        say(f"note: --engine llama.cpp decodes an adapter's exported GGUF, and no --adapter was given; {instead}.")
        return None
    for folder in adapters.values():
        check_adapter_folder(folder)  # a missing or damaged folder is an error, not a reason to fall back
    try:
        model = LlamaCppModel(base, adapters)
        model.llm()
    except ValueError as err:
        say(f"note: llama.cpp cannot run this model ({err}); {instead}.")
        return None
    return model


__all__ = ["ENGINES", "GGUF_NAME", "LlamaCppModel", "cached_gguf", "llama_cpp_model"]
