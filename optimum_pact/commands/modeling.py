"""PactModelForCausalLM: use what you trained, on the same packed NVFP4 base and the same backends as training.

The base is loaded once as NVFP4 `FrozenLinear`s (quantized while the checkpoint streams in, or read from a saved
ModelOpt-layout folder), on ONE backend; adapters are peft's, several on one base: `load_adapter(DIR, name)` and
`set_adapter(name)` switch people without re-quantizing or copying the base. `generate` is transformers' own
(greedy, sampling, KV cache), `chat` renders the model's chat template.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from peft import PeftModel

from peft_ext import PactConfig

from ..dataflow import FrozenLinear
from ..precision import resolve_dtype
from ..quantizer import QUANT_METHOD, PactQuantizationConfig
from .data.trained_on import TrainedOn, longest_answer_tokens, prompt_input
from .layer_precisions import LayerPrecisions
from .model_folder import adapter_loading, check_adapter_folder, load_tokenizer, resolve_model
from .packed_cache import load_packed
from .rounded_base import base_codes_file

logger = logging.getLogger(__name__)


class PactModelForCausalLM:
    """A causal LM on PACT's NVFP4 base plus LoRA adapters, for generation (the Optimum model-class manner).

    `model` is the peft model (or the bare base before any adapter), `tokenizer` its tokenizer, `backend` the one
    backend every frozen product runs on (`backend.counts` tallies them).
    """

    def __init__(self, model, tokenizer, base_path: str, codes: Path | None = None):
        self.model, self.tokenizer, self.base_path = model, tokenizer, base_path
        self.trained_on: dict[str, TrainedOn | None] = {}  # per adapter: the data it learned (pact_data.json)
        frozen = [m for m in model.modules() if isinstance(m, FrozenLinear)]
        if not frozen:
            raise ValueError(f"{base_path}: no linear layer was put on the NVFP4 base; is it a causal LM?")
        self.backend = frozen[0].backend
        self.precisions = LayerPrecisions(base_path, model, codes)  # codes: the base's own rounding, if it has one
        self.packed_base = _packed_checkpoint(base_path)  # a saved NVFP4 folder: no weights to build 16-bit ones

    @classmethod
    def from_pretrained(
        cls,
        base: str | None = None,
        adapter: str | dict[str, str] | None = None,
        backend: str = "torch",
        backend_options: dict | None = None,
        dtype: str | torch.dtype = "auto",
    ) -> PactModelForCausalLM:
        """Load `base` (a model folder or Hub id; None: the default model) on the NVFP4 base with `backend`, then
        `adapter`: a folder, or {name: folder} for several (the first is active). A missing or damaged folder is
        an error naming it (FileNotFoundError, ValueError), raised before the base is loaded where it can be.

        What was trained is what runs: the base is built as the first adapter was trained on it, in the dtype its
        frozen weights were built from (`dtype="auto"`; for an adapter that does not record it, bf16) and with its
        16-bit linears 16-bit (`PactConfig.sixteen_bit_modules`). Another adapter gets its own 16-bit set when it is
        active (`set_adapter`)."""
        adapters = {"default": adapter} if isinstance(adapter, (str, Path)) else dict(adapter or {})
        path = resolve_model(base, next(iter(adapters.values()), None))
        configs = {name: read_adapter_config(folder) for name, folder in adapters.items()}
        dtype, dense = trained_base(next(iter(configs.values()), None), path, dtype)
        quantization = PactQuantizationConfig(
            backend=backend, backend_options=backend_options, modules_in_16bit=dense or None
        )
        codes = base_codes_file(next(iter(adapters.values()), None))  # a base rounded for the first adapter
        model = load_packed(path, base, quantization, dtype, codes)  # quantized once, then read from PACT's cache
        model.eval()
        tokenizer = load_tokenizer(path, base)
        self = cls(model, tokenizer, path, codes)
        for name, folder in adapters.items():
            self.load_adapter(folder, name, config=configs[name])
        if adapters:
            self.set_adapter(next(iter(adapters)))
        return self

    def load_adapter(self, folder: str | Path, name: str, config: PactConfig | None = None) -> None:
        """Add the adapter saved in `folder` under `name` (peft's own machinery: the base is not copied or changed).
        Its 16-bit linears are held 16-bit while it is active (`set_adapter`): a layer that another adapter needs
        in the other format is kept both ways, the 16-bit copy read from the base's checkpoint."""
        if config is None:
            config = read_adapter_config(folder)  # checks the folder (from_pretrained read it already)
        folder = str(folder)
        self._check_base(folder, config)
        trained_on = TrainedOn.load(folder)
        config.inference_mode = True
        if isinstance(self.model, PeftModel) and name in self.model.peft_config:
            raise ValueError(f"an adapter named {name!r} is loaded already; pick another name")
        sixteen = config.sixteen_bit_modules()
        if sixteen and self.packed_base:
            logger.warning(
                "%s is a saved NVFP4 checkpoint, which holds no full-precision weights to rebuild the %d linears %s "
                "was trained with 16-bit from; they run NVFP4 here. Pass --model with the base it was trained on.",
                self.base_path,
                len(sixteen),
                folder,
            )
            sixteen, config = [], config._replace(protected_modules=[], precision_plan=None)
        self.precisions.add(name, sixteen, base_codes_file(folder))
        with adapter_loading(folder, self.base_path):
            if isinstance(self.model, PeftModel):
                self.model.add_adapter(name, config)
                self.model.load_adapter(folder, adapter_name=name)
            else:
                self.precisions.apply(self.model, name)  # the base in this adapter's formats before peft wraps it
                self.model = PeftModel.from_pretrained(self.model, folder, adapter_name=name, config=config)
        self.model.eval()
        self.trained_on[name] = trained_on
        self.precisions.apply(self.model, self.model.active_adapter)  # peft keeps the active adapter active

    def _check_base(self, folder: str, config: PactConfig) -> None:
        trained_on = config.base_model_name_or_path
        if not trained_on:
            return
        mine = json.loads(Path(self.base_path, "config.json").read_text()) if Path(self.base_path).is_dir() else {}
        theirs = Path(trained_on) / "config.json"
        if theirs.is_file():
            other = json.loads(theirs.read_text())
            keys = ("model_type", "hidden_size", "num_hidden_layers", "vocab_size", "intermediate_size")
            differ = {k: (other.get(k), mine.get(k)) for k in keys if other.get(k) != mine.get(k)}
            if differ:
                raise ValueError(
                    f"{folder} was trained on {trained_on}, which differs from this base {self.base_path} in "
                    + ", ".join(f"{k} ({a} vs {b})" for k, (a, b) in differ.items())
                    + "; load it on the base it was trained on."
                )

    @property
    def adapters(self) -> list[str]:
        return list(self.model.peft_config) if isinstance(self.model, PeftModel) else []

    def set_adapter(self, name: str) -> None:
        """Make adapter `name` the one generation uses (no weight is copied or re-quantized)."""
        if name not in self.adapters:
            raise ValueError(f"no adapter named {name!r}; loaded: {self.adapters or 'none'}")
        self.model.set_adapter(name)
        self.precisions.apply(self.model, name)

    def generate(self, *args, **kwargs):
        """transformers' `generate` on the model with the active adapter (greedy unless `do_sample=True`)."""
        pad = self.tokenizer.pad_token_id
        kwargs.setdefault("pad_token_id", pad if pad is not None else self.tokenizer.eos_token_id)  # id 0 is an id
        with torch.no_grad():
            return self.model.generate(*args, **kwargs)

    @property
    def active_trained_on(self) -> TrainedOn | None:
        """What the active adapter was trained on (None: no adapter, or one without pact_data.json)."""
        return self.trained_on.get(self.model.active_adapter) if self.adapters else None

    def max_answer_tokens(self) -> int | None:
        """A tagging adapter's longest answer in tokens, its end of sequence included (None: no such bound)."""
        return max_answer_tokens(self.tokenizer, self.active_trained_on)

    def prompt_ids(self, messages: list[dict] | str) -> torch.Tensor:
        """Token ids to generate after, formatted the way the active adapter was trained (`prompt_ids`)."""
        return prompt_ids(self.tokenizer, self.active_trained_on, messages)

    def context_length(self) -> int | None:
        return getattr(self.model.config, "max_position_embeddings", None)


def read_adapter_config(folder: str | Path) -> PactConfig:
    """The PactConfig of the adapter in `folder` (a plain peft LoRA adapter: PACT's defaults), the folder checked."""
    folder = check_adapter_folder(folder)
    return PactConfig.from_pretrained(str(folder), allow_missing_sidecar=True)


def trained_base(
    config: PactConfig | None, path: str, dtype: str | torch.dtype = "auto", unrecorded: str | torch.dtype = "auto"
) -> tuple[torch.dtype, list[str]]:
    """How to load the base at `path` for an adapter of `config` (None: no adapter) as it was trained: the dtype its
    frozen weights were built from (`dtype="auto"`: the adapter's `base_dtype`, or `unrecorded` for an adapter that
    records none; "auto" there is generation's bf16) and its 16-bit linears (none on a saved NVFP4 folder, which
    holds no weights to build them from)."""
    if dtype == "auto":
        dtype = config.base_dtype if config is not None and config.base_dtype is not None else unrecorded
    dense = config.sixteen_bit_modules() if config is not None and not _packed_checkpoint(path) else []
    return resolve_dtype(dtype, inference=True), dense


def _packed_checkpoint(path: str) -> bool:
    """Whether `path` is a saved PACT checkpoint (its linears already NVFP4), not a full-precision one."""
    config = Path(path, "config.json")
    if not config.is_file():
        return False
    quantization = json.loads(config.read_text()).get("quantization_config") or {}
    return quantization.get("quant_method") == QUANT_METHOD


def max_answer_tokens(tokenizer, record: TrainedOn | None) -> int | None:
    """A tagging adapter's longest answer in tokens, its end of sequence included (None: no such bound)."""
    return longest_answer_tokens(record, lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"]))


def prompt_ids(tokenizer, record: TrainedOn | None, messages: list[dict] | str) -> torch.Tensor:
    """Token ids to generate after, formatted the way an adapter that learned `record` was trained
    (`trained_on.prompt_input`): text tokenized as is, or turns rendered with the model's chat template."""
    prompt = prompt_input(record, messages, bool(getattr(tokenizer, "chat_template", None)))
    if isinstance(prompt, str):
        return tokenizer(prompt, return_tensors="pt")["input_ids"]
    out = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, return_tensors="pt")
    return out["input_ids"] if hasattr(out, "keys") else out


__all__ = ["PactModelForCausalLM", "max_answer_tokens", "prompt_ids", "read_adapter_config", "trained_base"]
