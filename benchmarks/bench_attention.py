"""Attention while training on the CPU: `pact_sdpa` (optimum_pact.attention) against transformers' sdpa, per layer.

One layer's attention, forward + backward, on SmolLM2-135M's heads (9 query heads on 3 key/value heads, head dim
64), bf16, at the shapes the main job and bench_train_step give it: batch x length from 8 x 20 (a padded main-job
batch) and 1 x 135 (the same batch padding-free: 8 examples of ~17 tokens in one row) to 4 x 512. Padded batches get
sdpa_mask's bool mask (row 0 padded by a quarter), a packed row the mask that keeps its examples apart (causal inside
each), other single rows none (causal). Arms per shape, interleaved over --rounds: `sdpa` (transformers' function,
the flash kernel on the CPU), `pact_sdpa` (fp32 matmuls up to
EAGER_MAX_LENGTH keys and EAGER_MAX_SCORES scores, sdpa above) and `sdpa_dup`
(sdpa again: the noise floor). Prints one JSON line: per shape the median milliseconds and pact_sdpa / sdpa; with
--output FOLDER also writes it to FOLDER/results.json.

    python benchmarks/bench_attention.py [--rounds 30] [--output benchmarks/results/attention]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from datetime import date
from pathlib import Path

from common import cpu_model, machine

# (batch, length, examples per row): more than one example is a packed (padding-free) row
SHAPES = ((8, 20, 1), (8, 40, 1), (1, 135, 1), (1, 135, 8), (4, 128, 1), (1, 300, 1), (4, 256, 1), (4, 512, 1))
HEADS, KV_HEADS, DIM = 9, 3, 64


class _Layer:  # what the attention functions read from the attention module
    num_key_value_groups, is_causal, training = HEADS // KV_HEADS, True, True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--output", help="a folder: results.json is written there")
    args = parser.parse_args()
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from optimum_pact.attention import EAGER_MAX_LENGTH, EAGER_MAX_SCORES, short_attention_forward

    torch.manual_seed(0)
    arms = {"sdpa": sdpa_attention_forward, "pact_sdpa": short_attention_forward, "sdpa_dup": sdpa_attention_forward}
    rows = []
    for batch, length, examples in SHAPES:
        q = torch.randn(batch, HEADS, length, DIM, dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.randn(batch, KV_HEADS, length, DIM, dtype=torch.bfloat16, requires_grad=True) for _ in "kv")
        mask = None
        if batch > 1:
            mask = torch.ones(batch, 1, length, length, dtype=torch.bool).tril()
            mask[0, :, :, length - length // 4 :] = False
        elif examples > 1:  # examples of near-equal lengths, each attending inside itself
            example = torch.arange(length) * examples // length
            mask = (example[:, None] == example[None, :]) & torch.ones(length, length, dtype=torch.bool).tril()
            mask = mask[None, None]
        grad = torch.randn(batch, length, HEADS, DIM, dtype=torch.bfloat16)
        times = {arm: [] for arm in arms}
        for i in range(args.rounds + 2):  # two warm-up rounds
            for arm, fn in arms.items():
                start = time.perf_counter()
                out, _ = fn(_Layer(), q, k, v, mask, scaling=DIM**-0.5)
                out.backward(grad)
                if i >= 2:
                    times[arm].append(time.perf_counter() - start)
        ms = {arm: 1e3 * statistics.median(t) for arm, t in times.items()}
        rows.append({"batch": batch, "length": length, "examples": examples, "scores": batch * HEADS * length * length,
                     "ms": {a: round(m, 3) for a, m in ms.items()},
                     "pact_sdpa_over_sdpa": round(ms["pact_sdpa"] / ms["sdpa"], 3),
                     "noise_sdpa_dup_over_sdpa": round(ms["sdpa_dup"] / ms["sdpa"], 3)})  # fmt: skip
    results = {"bench": "attention", "date": date.today().isoformat(), "cpu": cpu_model(),
               "machine": machine(),
               "threads": torch.get_num_threads(), "dtype": "bfloat16", "eager_max_length": EAGER_MAX_LENGTH,
               "eager_max_scores": EAGER_MAX_SCORES,
               "rounds": args.rounds, "shapes": rows}  # fmt: skip
    if args.output:
        from optimum_pact.files import write_text_atomic

        Path(args.output).mkdir(parents=True, exist_ok=True)
        write_text_atomic(Path(args.output) / "results.json", json.dumps(results, indent=1) + "\n")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
