"""What each 4-bit format does to SmolLM2-135M-Instruct before any training: NVFP4 under each scale rule, against
fp32 and bitsandbytes' nf4, on the personalization benchmark's users.

For each format every decoder linear's weight is replaced by what the format reconstructs (`fake_quantize`, which
is what PACT's dequantizer computes from the packed bytes; `nf4_dequantized`, bitsandbytes' arithmetic), then:
the relative weight error over all of them (||W - deq(q(W))|| / ||W||) and the LM loss over every token of the
held-out items of the 12 nightly users (the built-in one and 11 generated; text and tag), in fp32. One process, one
model, formats side by side; deterministic (no timing), so one run is the figure.

    python benchmarks/bench_scale_rule.py      # 15 minutes on 2 cores beside a test run (alone: less)
"""

from __future__ import annotations

import json
import sys
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))


def lm_loss(model, tokenizer, items: list[dict]) -> float:
    """Mean loss per predicted token over the items, each scored alone (no padding)."""
    import torch

    total = count = 0.0
    with torch.no_grad():
        for item in items:
            ids = tokenizer(f"{item['text']} {item['label']}", return_tensors="pt").input_ids
            total += model(input_ids=ids, labels=ids).loss.item() * (ids.shape[1] - 1)
            count += ids.shape[1] - 1
    return total / count


def main() -> dict:
    import torch
    from bench_train_step import cpu_model
    from personal_tasks import nightly_tasks
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from optimum_pact.commands.default_model import ensure_default_model
    from optimum_pact.nvfp4 import SCALE_RULES, fake_quantize
    from peft_ext.blocks import decoder_linears
    from peft_ext.ranking import nf4_dequantized

    path = ensure_default_model()
    tokenizer = AutoTokenizer.from_pretrained(path)
    items = [item for task in nightly_tasks(11, 200, 0.2, 0) for item in task.test]  # eval_personalization's
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    linears = decoder_linears(model)
    originals = {name: layer.weight.detach().clone() for name, layer in linears.items()}
    formats = {"fp32": lambda w: w, "nf4": nf4_dequantized}
    for rule in SCALE_RULES:
        formats[f'nvfp4 "{rule}"' + (" (default)" if rule == SCALE_RULES[0] else "")] = partial(
            fake_quantize, scale_rule=rule
        )
    results = {}
    for name, reconstruct in formats.items():
        error = norm = 0.0
        with torch.no_grad():
            for layer_name, layer in linears.items():
                w = originals[layer_name]
                r = reconstruct(w)
                error += (r - w).double().square().sum().item()
                norm += w.double().square().sum().item()
                layer.weight.copy_(r)
        results[name] = {"weight_rel_error": (error / norm) ** 0.5, "lm_loss": lm_loss(model, tokenizer, items)}
        print(f"{name}: {results[name]}", file=sys.stderr, flush=True)
    summary = {"bench": "bench_scale_rule", "cpu": cpu_model(), "items": len(items), "linears": len(linears),
               "formats": results}  # fmt: skip
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
