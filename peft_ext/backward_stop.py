"""The speed setting's cut: no gradient, saved activation or recomputation below the lowest adapted block.

`stop_backward_below` installs it (forward pre-hooks on two decoder blocks) and returns a `BackwardStop` that removes
it again.
"""

from __future__ import annotations

import torch
from torch import nn

from .blocks import _unwrap, block_index, decoder_blocks


class BackwardStop:
    """The hooks `stop_backward_below` installed; `remove()` takes them out again."""

    def __init__(self, handles: list):
        self.handles = handles

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


# Names of the forward hooks that make the input embeddings' output require grad: transformers'
# `enable_input_require_grads` (kept in `_require_grads_hooks`, removable through `disable_input_require_grads`) and
# peft's fallback copies in `prepare_model_for_kbit_training` / `PeftModel` (registered without a handle).
_REQUIRE_GRAD_HOOK_NAMES = ("make_inputs_require_grads", "make_inputs_require_grad")


def _remove_input_require_grad_hooks(model: nn.Module) -> None:
    """Remove the embedding hooks that force `requires_grad` on the embeddings' output."""
    from transformers import PreTrainedModel

    inner = _unwrap(model)
    for module in inner.modules():
        if isinstance(module, PreTrainedModel):
            module.disable_input_require_grads()
    embeddings = inner.get_input_embeddings() if hasattr(inner, "get_input_embeddings") else None
    if embeddings is None:
        return
    # peft's fallback registers without keeping a handle: the one private structure touched here, emptied the way
    # torch's RemovableHandle.remove does (tests/test_protection.py fails loudly if torch changes it).
    for key, hook in list(embeddings._forward_hooks.items()):
        if getattr(hook, "__name__", "") in _REQUIRE_GRAD_HOOK_NAMES:
            for hooks in (embeddings._forward_hooks, embeddings._forward_hooks_with_kwargs):
                hooks.pop(key, None)
            embeddings._forward_hooks_always_called.pop(key, None)


def _first_tensor(args: tuple, kwargs: dict) -> tuple[tuple, dict, torch.Tensor | None]:
    if args and isinstance(args[0], torch.Tensor):
        return args, kwargs, args[0]
    return args, kwargs, kwargs.get("hidden_states")


def _replace_hidden(args: tuple, kwargs: dict, hidden: torch.Tensor) -> tuple[tuple, dict]:
    if args and isinstance(args[0], torch.Tensor):
        return (hidden, *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": hidden}


def _uses_reentrant_checkpointing(block: nn.Module) -> bool:
    if not (getattr(block, "gradient_checkpointing", False) and block.training and torch.is_grad_enabled()):
        return False
    func = getattr(block, "_gradient_checkpointing_func", None)
    return bool(getattr(func, "keywords", {}).get("use_reentrant", True))


def stop_backward_below(model: nn.Module, lowest_block: int) -> BackwardStop:
    """Make sure no gradient is computed in blocks below `lowest_block` (the lowest adapted block), nor embeddings.

    Call it after `get_peft_model` (and after `prepare_model_for_kbit_training`, if used); it keeps working when
    gradient checkpointing is enabled later (e.g. by the Trainer at the start of training). It

    1. refuses (ValueError) if any parameter below `lowest_block` or in the input embeddings is trainable: the
       speed setting would silently not train it;
    2. removes the input-embedding forward hooks that transformers' `enable_input_require_grads` (called by
       `activation_checkpointing_enable`, peft's `prepare_model_for_kbit_training` and `PeftModel` when
       checkpointing is on) and peft's fallback copies install to force `requires_grad` on the embeddings' output;
    3. detaches the hidden states entering block 0 (a forward pre-hook), so even a hook re-installed later (the
       Trainer enables checkpointing after this call) cannot make the lower blocks build an autograd graph: no
       backward op, no saved activation, no recomputation below `lowest_block`;
    4. under reentrant checkpointing only, marks the hidden states entering `lowest_block` as requiring grad: the
       reentrant `checkpoint` returns a graph-less output when no input requires grad, which would silently leave
       the adapters of that block untrained. Non-reentrant checkpointing (transformers' default) needs nothing.

    Calling it again replaces the previous call's hooks. Returns a `BackwardStop` whose `remove()` undoes 3-4.
    """
    blocks = decoder_blocks(model)
    if isinstance(lowest_block, bool) or not isinstance(lowest_block, int) or not 0 <= lowest_block < len(blocks):
        raise ValueError(f"lowest_block={lowest_block!r} must be an integer from 0 to {len(blocks) - 1}.")
    inner = _unwrap(model)
    below = [
        name
        for name, p in inner.named_parameters()
        if p.requires_grad and block_index(name) is not None and block_index(name) < lowest_block
    ]
    embeddings = inner.get_input_embeddings() if hasattr(inner, "get_input_embeddings") else None
    output = inner.get_output_embeddings() if hasattr(inner, "get_output_embeddings") else None
    tied = {id(p) for p in output.parameters()} if output is not None else set()
    if embeddings is not None:  # a tied lm_head trains through the output side, which stays above the cut
        below += [
            f"input embeddings.{n}" for n, p in embeddings.named_parameters() if p.requires_grad and id(p) not in tied
        ]
    if below:
        raise ValueError(
            f"stop_backward_below({lowest_block}) found trainable parameters below block {lowest_block}: "
            f"{below[:5]}. The speed setting cannot train them: adapt only the top blocks (speed_targets) or use "
            "adapt='quality'."
        )
    _remove_input_require_grad_hooks(model)

    def cut(module, args, kwargs):
        args, kwargs, hidden = _first_tensor(args, kwargs)
        if hidden is None or not hidden.requires_grad:
            return None
        return _replace_hidden(args, kwargs, hidden.detach())

    def resume(module, args, kwargs):
        args, kwargs, hidden = _first_tensor(args, kwargs)
        if hidden is None or hidden.requires_grad or not _uses_reentrant_checkpointing(module):
            return None
        return _replace_hidden(args, kwargs, hidden.detach().requires_grad_(True))

    previous = getattr(blocks, "_pact_backward_stop", None)
    if previous is not None:  # called again (e.g. at on_train_begin): replace, never stack
        previous.remove()
    handles = []
    if lowest_block > 0:
        handles.append(blocks[0].register_forward_pre_hook(cut, with_kwargs=True))
    handles.append(blocks[lowest_block].register_forward_pre_hook(resume, with_kwargs=True))
    blocks._pact_backward_stop = BackwardStop(handles)
    return blocks._pact_backward_stop
