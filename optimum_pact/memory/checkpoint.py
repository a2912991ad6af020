"""Per-block activation checkpointing with selective caching, disk offload of block inputs and chunked MLP recompute.

What happens to each tensor a decoder block saves for backward:
- **block input** (the residual stream entering the block): the one tensor a checkpointed block keeps between
  forward and backward. It goes to disk through `ActivationOffloader` (async write, prefetched read, file deleted
  after use). The other inputs (rotary cos/sin, attention mask, position ids) are shared by every block and held
  once by the model's forward anyway, so they stay in RAM: offloading them would write one copy per block.
- **attention output** (output and log-sum-exp of scaled-dot-product attention): cached in RAM while the step's
  cache stays under `cache_mib`. It costs tokens x hidden per block to hold, and recomputing it is the only part
  of the block whose cost grows with the square of the context; the cache is per step (freed by the block's
  backward). Off by default (`cache_mib=0`): on Qwen2.5-0.5B at 3k tokens (CPU) a 64 MiB cache added 60 MB to
  the live peak (232 -> 291 MB) and no measurable speed (76 s vs 84 s a step, within noise); it pays off only
  where attention dominates the recomputation (contexts well beyond 4k, or a slow attention kernel).
- **everything else** (norms, projections, LoRA paths, MLP): recomputed in backward by running the block's modules
  as they are, so a `FrozenLinear` runs its forward product again (the third frozen product).
- **MLP**: recomputed in chunks of `mlp_chunk_tokens` tokens, each its own (nested) checkpoint, so backward holds
  the MLP intermediates (tokens x intermediate, several of them) of one chunk instead of the whole sequence. When
  the block itself is replayed in backward, the MLP chunks only re-save their inputs and skip the computation (its
  result is never used: each chunk recomputes itself when its own backward comes), so the MLP runs twice per step,
  not three times.

Implementation: `torch.utils.checkpoint.checkpoint(use_reentrant=False)` per block; selective caching through its
documented `context_fn=create_selective_checkpoint_contexts(policy)`; offload through
`torch.autograd.graph.saved_tensors_hooks` around the checkpoint call, which therefore see only the tensors the
checkpoint saves as its inputs. Blocks are found by duck typing (the largest `nn.ModuleList` named `layers`, `h` or
`blocks`) and wrapped by setting an instance `forward` (state dict and module names unchanged; `restore()` undoes
it).
"""

from __future__ import annotations

import contextvars
import functools
from collections.abc import Callable

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from .offload import ActivationOffloader

BLOCK_LIST_NAMES = ("layers", "h", "blocks")
CACHE_KWARGS = ("cache", "past_key_values", "layer_past")  # a KV cache must not be updated twice (recompute)
_REPLAY = contextvars.ContextVar("pact_block_replay", default=False)  # True while a block is recomputed
_aten = torch.ops.aten
ATTENTION_OPS = tuple(
    op
    for name in (
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
    )
    if (op := getattr(_aten, name, None)) is not None
)


def find_blocks(model: nn.Module) -> nn.ModuleList:
    """The decoder blocks: the largest `nn.ModuleList` whose name ends in `layers`, `h` or `blocks`."""
    candidates = [
        module
        for name, module in model.named_modules()
        if isinstance(module, nn.ModuleList) and name.rsplit(".", 1)[-1] in BLOCK_LIST_NAMES and len(module)
    ]
    if not candidates:
        raise ValueError(
            f"{type(model).__name__} has no list of decoder blocks named {' / '.join(BLOCK_LIST_NAMES)}; "
            "memory savers need a decoder-only model such as Llama or Qwen2."
        )
    return max(candidates, key=len)


class _StepCache:
    """Bytes of attention outputs cached in RAM in the current forward; reset when the first block runs."""

    def __init__(self, budget_bytes: int):
        self.budget, self.used = budget_bytes, 0

    def reserve(self, nbytes: int) -> bool:
        if self.used + nbytes > self.budget:
            return False
        self.used += nbytes
        return True


def _policy() -> Callable:
    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op.overloadpacket in ATTENTION_OPS else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


class BlockCheckpointing:
    """Wraps every decoder block of `model` in checkpointing; see the module docstring for what is kept where.

    `offloader=None` keeps the block inputs in RAM (plain checkpointing). `cache_mib=0` recomputes attention too.
    `mlp_chunk_tokens=None` recomputes each block's MLP in one piece. Active only while the model is in training
    mode with gradients enabled; evaluation and generation run the blocks unchanged.
    """

    def __init__(
        self,
        model: nn.Module,
        offloader: ActivationOffloader | None = None,
        cache_mib: float = 0.0,
        mlp_chunk_tokens: int | None = 512,
    ):
        if cache_mib < 0:
            raise ValueError(f"cache_mib={cache_mib!r} must be >= 0 (0 caches nothing and recomputes attention).")
        if mlp_chunk_tokens is not None and (isinstance(mlp_chunk_tokens, bool) or mlp_chunk_tokens < 1):
            raise ValueError(f"mlp_chunk_tokens={mlp_chunk_tokens!r} must be a positive integer or None.")
        self.blocks = find_blocks(model)
        already = [i for i, b in enumerate(self.blocks) if getattr(b, "gradient_checkpointing", False)]
        if already:
            raise ValueError(
                "The model already uses transformers' gradient checkpointing; memory savers checkpoint the blocks "
                "themselves. Call model.gradient_checkpointing_disable() (or leave gradient_checkpointing=False)."
            )
        self.offloader = offloader
        self.cache = _StepCache(int(cache_mib * 2**20))
        self.mlp_chunk_tokens = mlp_chunk_tokens
        self._wrapped: list[nn.Module] = []
        self._replaced: dict[nn.Module, Callable] = {}  # an MLP's own instance forward (a fused one) wrapped in chunks
        for index, block in enumerate(self.blocks):
            self._wrap(index, block)

    def _wrap(self, index: int, block: nn.Module) -> None:
        if "forward" in vars(block):
            raise ValueError(f"Block {index} ({type(block).__name__}) already has its forward replaced.")
        original = block.forward

        @functools.wraps(original)
        def forward(*args, **kwargs):
            if not (block.training and torch.is_grad_enabled()):
                return original(*args, **kwargs)
            return self._run(index, original, args, kwargs)

        block.forward = forward
        self._wrapped.append(block)
        mlp = getattr(block, "mlp", None)
        if self.mlp_chunk_tokens is not None and isinstance(mlp, nn.Module):
            if "forward" in vars(mlp):  # replaced before (optimum_pact.fusion): chunk that one, give it back after
                self._replaced[mlp] = vars(mlp)["forward"]
            mlp.forward = functools.partial(_chunked_mlp, mlp.forward, mlp, self.mlp_chunk_tokens)
            self._wrapped.append(mlp)

    def _run(self, index: int, original: Callable, args: tuple, kwargs: dict):
        if not args and "hidden_states" in kwargs:  # the block input must be positional to be saved (offloaded)
            args = (kwargs.pop("hidden_states"),)
        for name in CACHE_KWARGS:
            if kwargs.get(name) is not None:
                kwargs[name] = None
        if "use_cache" in kwargs:
            kwargs["use_cache"] = False
        if index == 0:  # a new forward pass
            self.cache.used = 0
            if self.offloader is not None:
                self.offloader.begin_forward()
        hidden = args[0]
        cache_attention = self.cache.reserve(hidden.numel() * hidden.element_size())
        options = {"use_reentrant": False}
        if cache_attention:
            options["context_fn"] = functools.partial(create_selective_checkpoint_contexts, _policy())
        call = functools.partial(checkpoint, _replay_aware(original), *args, **options, **kwargs)
        if self.offloader is None:
            return call()
        with torch.autograd.graph.saved_tensors_hooks(*self._hooks(hidden)):
            return call()

    def _hooks(self, hidden: torch.Tensor):
        """Offload the block input; any other tensor saved as a checkpoint input (shared by all blocks) stays."""
        offloader = self.offloader
        # Only the address and shape: the hooks live as long as the saved tensor, and a reference to `hidden` in
        # their closure would keep every block input in memory, offloaded or not.
        ptr, shape = hidden.data_ptr(), hidden.shape

        def pack(tensor):
            if tensor.data_ptr() == ptr and tensor.shape == shape:
                return offloader.pack(tensor)
            return tensor

        def unpack(packed):
            return offloader.unpack(packed) if not isinstance(packed, torch.Tensor) else packed

        return pack, unpack

    def restore(self) -> None:
        """Give every wrapped module its own forward back."""
        for module in self._wrapped:
            vars(module).pop("forward", None)
            if module in self._replaced:
                module.forward = self._replaced.pop(module)
        self._wrapped = []


def _replay_aware(block_forward: Callable) -> Callable:
    """The block's forward, telling `_chunked_mlp` whether this call is the checkpoint's replay (2nd call on)."""
    calls = 0

    def run(*args, **kwargs):
        nonlocal calls
        calls += 1
        token = _REPLAY.set(calls > 1)
        try:
            return block_forward(*args, **kwargs)
        finally:
            _REPLAY.reset(token)

    return run


def _skip(chunk: torch.Tensor) -> torch.Tensor:
    # Stands in for the MLP (hidden -> hidden) in the block's replay, whose MLP output is never read. It runs no
    # operator at all: selective checkpointing requires the replay to run no operator the forward did not.
    return chunk


def _chunked_mlp(forward: Callable, mlp: nn.Module, chunk_tokens: int, x: torch.Tensor, *args, **kwargs):
    """Run a token-wise MLP over chunks of the sequence, each checkpointed (inside the block's checkpoint)."""
    if not (mlp.training and torch.is_grad_enabled()) or args or kwargs or x.dim() < 2:
        return forward(x, *args, **kwargs)
    tokens = x.reshape(-1, x.shape[-1])
    if tokens.shape[0] <= chunk_tokens:
        return forward(x)
    run = _skip if _REPLAY.get() else forward  # in the block's replay only the chunk inputs must be saved again
    outputs = [checkpoint(run, chunk, use_reentrant=False) for chunk in tokens.split(chunk_tokens)]
    return torch.cat(outputs).view(*x.shape[:-1], -1)
