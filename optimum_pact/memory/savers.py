"""`MemorySavers`: switch the memory savers on for a causal LM (a transformers model or a peft model wrapping one).

    with MemorySavers(model, offload_dir="out/offload", subset_k=1000):
        loss = model(input_ids=ids, labels=labels).loss   # training mode: no [tokens, vocab] logits
        loss.backward()

Nothing about the model changes but two instance attributes: each decoder block's (and MLP's) `forward`, wrapped for
checkpointing, and the causal LM's `forward`, which in training mode with labels returns only the loss computed by
`causal_lm_loss` (logits masking, subset softmax). In eval mode, without labels, or without gradients the model runs
unchanged. `close()` (or leaving the `with`) restores the forwards and deletes the offload folder.
"""

from __future__ import annotations

import functools
import os

import torch
from torch import nn

from .checkpoint import BlockCheckpointing
from .logits_mask import causal_lm_loss, output_layer
from .offload import ActivationOffloader
from .streaming import DEFAULT_WINDOW_BYTES, WeightStream, streaming_available
from .subset_softmax import DEFAULT_K, TokenNeighbours, check_subset_k
from .weights import WeightsFile, map_frozen_weights

MEMORY_SAVER_PRESETS = {
    "none": {"checkpoint": False, "offload": False, "map_weights": False, "subset_k": None, "mask_logits": False},
    # the output head only at labelled positions, nothing recomputed: exact, and faster where prompts are unlabelled
    "logits": {"checkpoint": False, "offload": False, "map_weights": False, "subset_k": None, "mask_logits": True},
    # exact: same loss and gradients as without savers (up to float summation order)
    "exact": {"checkpoint": True, "offload": True, "map_weights": True, "subset_k": None, "mask_logits": True},
    # exact + the top-k softmax approximation
    "full": {"checkpoint": True, "offload": True, "map_weights": True, "subset_k": DEFAULT_K, "mask_logits": True},
}


class SaverOutput(dict):
    """The model's output under memory savers in training: the loss only (logits were never built)."""

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(
                f"{name!r} is not computed while memory savers are on in training (only the loss is); run the "
                "model in eval mode, or close the savers, to get logits."
            ) from None

    def __getitem__(self, key):
        return list(self.values())[key] if isinstance(key, int) else super().__getitem__(key)

    def to_tuple(self) -> tuple:
        return tuple(self.values())


class MemorySavers:
    """Activation checkpointing (+ disk offload, selective caching, chunked MLP) and the logits-free loss.

    Args:
        model: a causal LM with decoder blocks in a `layers` list (Llama, Qwen2, SmolLM2, ...), or a peft model.
        checkpoint: checkpoint every decoder block (recompute in backward).
        offload: write each block's input to `offload_dir` between forward and backward (needs `checkpoint`).
        offload_dir: folder for the offload files (a private sub-folder is created and removed) and the weight
            mapping; default: the system temp dir.
        map_weights: keep the frozen weights memory-mapped from a file in `offload_dir` (`map_frozen_weights`;
            bit-identical values; not undone by `close()`).
        stream_weights: with `map_weights`, release each mapped weight's pages as soon as its use is over
            (`WeightStream`: one layer's packed weight and `window_bytes` of head rows resident at a time; the same
            losses and gradients). On by default where the platform has madvise (Linux).
        window_bytes: head / embedding rows read between two releases of the table (`WeightStream`).
        cache_mib: RAM budget per step for attention outputs kept instead of recomputed (default 0: recompute all;
            see `checkpoint.py` for when caching pays).
        mlp_chunk_tokens: recompute each MLP in chunks of this many tokens (None: whole sequence).
        subset_k: softmax over the target and its k - 1 nearest tokens (None: full vocabulary).
        mask_logits: run the output head only at labelled positions.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        checkpoint: bool = True,
        offload: bool = True,
        offload_dir: str | os.PathLike | None = None,
        map_weights: bool = False,
        cache_mib: float = 0.0,
        mlp_chunk_tokens: int | None = 512,
        subset_k: int | None = None,
        mask_logits: bool = True,
        stream_weights: bool | None = None,
        window_bytes: int = DEFAULT_WINDOW_BYTES,
    ):
        if offload and not checkpoint:
            raise ValueError("offload=True needs checkpoint=True: offload writes the checkpointed block inputs.")
        self.model = model
        self.base = model.get_base_model() if hasattr(model, "get_base_model") else model
        self.subset_k, self.mask_logits = subset_k, mask_logits
        if subset_k is not None or mask_logits:
            head = output_layer(self.base)  # fail fast: before any slow work
            if subset_k is not None:
                check_subset_k(subset_k, head.weight.shape[0])
        self.neighbours: TokenNeighbours | None = None
        self.offloader = ActivationOffloader(offload_dir) if offload else None
        self.mapped_weights: list[torch.Tensor] = []  # for LiveTensorTracker(mapped=...)
        self.weights_file: WeightsFile | None = None
        self.stream: WeightStream | None = None
        if stream_weights and not map_weights:
            raise ValueError("stream_weights=True needs map_weights=True: only mapped weights can be streamed.")
        if stream_weights and not streaming_available():
            raise ValueError("stream_weights=True needs Linux (madvise, /proc/self/maps); pass stream_weights=False.")
        self.checkpointing = None
        self._loss_wrapped = False
        try:
            if map_weights:
                folder = self.offloader.root if self.offloader is not None else offload_dir
                mapped = map_frozen_weights(model, folder)
                self.mapped_weights, self.weights_file = mapped["mapped"], mapped["file"]
                stream = streaming_available() if stream_weights is None else stream_weights
                if stream and self.weights_file is not None:
                    self.stream = WeightStream(self.base, self.weights_file, window_bytes)
            if subset_k is not None:  # after mapping: it holds the (mapped) output weight
                self.neighbours = TokenNeighbours(output_layer(self.base).weight, subset_k)
                self.neighbours.stream = self.stream
            if checkpoint:
                self.checkpointing = BlockCheckpointing(model, self.offloader, cache_mib, mlp_chunk_tokens)
            if subset_k is not None or mask_logits:
                self._wrap_loss()
        except BaseException:
            self.close()
            raise

    @classmethod
    def from_preset(cls, model: nn.Module, preset: str, **overrides) -> MemorySavers:
        """`preset` is one of MEMORY_SAVER_PRESETS ('none', 'logits', 'exact', 'full'); keywords override its
        options."""
        if preset not in MEMORY_SAVER_PRESETS:
            raise ValueError(f"memory saver {preset!r} is not one of {', '.join(MEMORY_SAVER_PRESETS)}.")
        return cls(model, **{**MEMORY_SAVER_PRESETS[preset], **overrides})

    def _wrap_loss(self) -> None:
        base = self.base
        if "forward" in vars(base):
            raise ValueError(f"{type(base).__name__}.forward is already replaced on this instance.")
        original = base.forward

        @functools.wraps(original)
        def forward(input_ids=None, attention_mask=None, *args, labels=None, **kwargs):
            if args or labels is None or not (base.training and torch.is_grad_enabled()):
                return original(input_ids, attention_mask, *args, labels=labels, **kwargs)
            if self.stream is not None:  # whatever the last backward or an eval left resident
                self.stream.release_all()
            loss = causal_lm_loss(
                base, input_ids, labels, attention_mask, neighbours=self.neighbours, mask_logits=self.mask_logits,
                stream=self.stream, **kwargs,
            )  # fmt: skip
            return SaverOutput(loss=loss)

        base.forward = forward
        self._loss_wrapped = True

    def stop_streaming(self) -> None:
        """Leave the mapped weights' pages to the kernel's own policy from now on (resident once touched)."""
        if self.stream is not None:
            self.stream.close()
            self.stream = None
            if self.neighbours is not None:
                self.neighbours.stream = None

    def close(self) -> None:
        """Restore the model's forwards, stop streaming and delete the offload folder (the weights stay mapped)."""
        self.stop_streaming()
        if self.checkpointing is not None:
            self.checkpointing.restore()
            self.checkpointing = None
        if self._loss_wrapped:
            vars(self.base).pop("forward", None)
            self._loss_wrapped = False
        if self.offloader is not None:
            self.offloader.close()

    def __enter__(self) -> MemorySavers:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def enable_memory_savers(model: nn.Module, preset: str | None = None, **options) -> MemorySavers:
    """Turn the savers on (`MemorySavers(model, **options)`, or a preset plus overrides); call `.close()` to undo."""
    return MemorySavers.from_preset(model, preset, **options) if preset else MemorySavers(model, **options)
