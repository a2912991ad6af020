"""What each 4-bit format does to SmolLM2-135M-Instruct before any training: NVFP4 under each scale rule, against
fp32 and bitsandbytes' nf4, on the personalization benchmark's users.

For each format every decoder linear's weight is replaced by what the format reconstructs (`fake_quantize`, which
is what PACT's dequantizer computes from the packed bytes; `nf4_dequantized`, bitsandbytes' arithmetic), then:
the relative weight error over all of them (||W - deq(q(W))|| / ||W||) and the LM loss over every token of the
held-out items of the 12 nightly users (the built-in one and 11 generated; text and tag), in fp32. One process, one
model, formats side by side; deterministic, so one run is the figure. Two checks of the default rule ride along:
how often its search lands on the best of every e4m3 scale the quantizer may store (codes 8 = 2**-6 to 126 = 448)
on every 7th linear (30 of 210), and what each rule costs at load (`quantize` over the 210 linears, median of 5;
the one timing, so the run should be alone).

    python benchmarks/bench_scale_rule.py      # 8 minutes alone on 2 cores
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


def search_vs_every_scale(weights: list) -> dict:
    """The default rule's block errors against the best of all 119 storable e4m3 scales, per block, over `weights`."""
    import torch

    from optimum_pact.nvfp4 import BLOCK_SIZE, tensor_scale
    from optimum_pact.nvfp4.format import _block_error, scale_blocks

    hits = blocks = 0
    chosen_error = best_error = 0.0
    for w in weights:
        scale, _, scale_2 = scale_blocks(w)
        magnitude = w.float().abs().reshape(w.shape[0], -1, BLOCK_SIZE)
        chosen = _block_error(magnitude, scale, scale_2)
        best = torch.full_like(chosen, float("inf"))
        for code in range(8, 127):
            candidate = torch.tensor(code, dtype=torch.uint8).view(torch.float8_e4m3fn).float().expand_as(scale)
            best = torch.minimum(best, _block_error(magnitude, candidate, tensor_scale(w)))
        hits += (chosen == best).sum().item()
        blocks += chosen.numel()
        chosen_error += chosen.double().sum().item()
        best_error += best.double().sum().item()
    return {"linears": len(weights), "blocks": blocks, "best_scale_fraction": hits / blocks,
            "error_over_best": chosen_error / best_error}  # fmt: skip


def quantize_seconds(weights: list, rule: str, repeats: int = 5) -> float:
    """Median wall-clock seconds to `quantize` every weight under `rule`."""
    import statistics
    import time

    from optimum_pact.nvfp4 import quantize

    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for w in weights:
            quantize(w, scale_rule=rule)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> dict:
    import torch
    from common import cpu_model
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
    weights = list(originals.values())
    for rule in SCALE_RULES:
        results[next(name for name in results if f'"{rule}"' in name)]["quantize_s"] = quantize_seconds(weights, rule)
    summary = {"bench": "bench_scale_rule", "cpu": cpu_model(), "threads": torch.get_num_threads(),
               "items": len(items), "linears": len(linears), "formats": results,
               "search_vs_every_scale": search_vs_every_scale(weights[::7])}  # fmt: skip
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
