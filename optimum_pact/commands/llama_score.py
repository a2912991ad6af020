"""A GGUF's held-out accuracy as llama.cpp computes it: the number a person gets from the file on a phone.

Each held-out item gets the label whose tokens have the highest summed log-probability after the prompt, exactly as
`evaluation.score_labels` scores PACT's own models; the token ids come from the HF tokenizer, so both sides score the
same ids. Needs the `llama` extra (llama-cpp-python).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import torch

from .data import format_example


def llama_cpp_available() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def llama_cpp_accuracy(path: str | Path, tokenizer, items: list[dict], labels: list[str], **options) -> float:
    """Held-out accuracy of the GGUF at `path` on labelled `items` (`{"text", "label"}`), scored by llama.cpp;
    `options` go to `llama_cpp.Llama` (e.g. `lora_path`)."""
    from llama_cpp import Llama

    label_ids = [tokenizer(format_example("", label)[1], add_special_tokens=False)["input_ids"] for label in labels]
    settings = {"logits_all": True, "n_ctx": 512, "n_threads": torch.get_num_threads(), "verbose": False, **options}
    llm = Llama(model_path=str(path), **settings)
    correct = 0
    try:
        for item in items:
            prompt = tokenizer(format_example(item["text"], item["label"])[0])["input_ids"]
            llm.reset()
            llm.eval(prompt)
            scores = []
            for ids in label_ids:
                llm.n_tokens = len(prompt)  # back to the prompt (eval drops the cache past it), then this label
                llm.eval(ids[:-1])
                logits = torch.from_numpy(llm.scores[len(prompt) - 1 : len(prompt) - 1 + len(ids)])
                scores.append(torch.log_softmax(logits.double(), -1)[range(len(ids)), ids].sum().item())
            correct += labels[int(np.argmax(scores))] == item["label"]
    finally:
        llm.close()
    return correct / len(items)


__all__ = ["llama_cpp_accuracy", "llama_cpp_available"]
