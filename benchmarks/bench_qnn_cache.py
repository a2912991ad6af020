"""Compiled-graph cache: how much faster the qnn backend starts when its QNN context binaries are on disk.

A start is what a fresh process does before training can begin: the qnn backend builds (cold) or loads (warm) the
graphs of SmolLM2-135M's four linear shapes (576x576, 192x576, 1536x576, 576x1536; forward and input gradient) and
runs each product once on 512 tokens. Every arm is a fresh process: `cold` with an empty cache folder, `warm` with
the folder a cold start filled, `warm_dup` the same again (noise floor). Arms interleave round by round; prints one
JSON line with the median start times and warm / cold.

    python benchmarks/bench_qnn_cache.py [--rounds 3] [--soc-model 60]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time

SHAPES = ((576, 576), (192, 576), (1536, 576), (576, 1536))  # (out, in) of SmolLM2-135M's linears
ARMS = ("cold", "warm", "warm_dup")


def start(cache_dir: str, soc_model: str, tokens: int) -> float:
    """Seconds from creating the backend to the first forward and input gradient of every shape."""
    import torch

    from optimum_pact.backends import get_backend
    from optimum_pact.nvfp4 import quantize

    torch.manual_seed(0)
    weights = [quantize(torch.randn(n, k)) for n, k in SHAPES]
    began = time.perf_counter()
    backend = get_backend("qnn", cache_dir=cache_dir, soc_model=soc_model)
    for weight, (n, k) in zip(weights, SHAPES):
        handle = backend.prepare(weight)
        backend.forward(torch.randn(tokens, k), handle)
        backend.input_grad(torch.randn(tokens, n), handle)
    return time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--soc-model", default="60")
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--child", metavar="CACHE_DIR", help=argparse.SUPPRESS)  # internal: one start, this process
    args = parser.parse_args()
    if args.child:
        print(start(args.child, args.soc_model, args.tokens))
        return

    def run(cache_dir: str) -> float:
        cmd = [sys.executable, __file__, "--child", cache_dir, "--soc-model", args.soc_model]
        out = subprocess.run([*cmd, "--tokens", str(args.tokens)], capture_output=True, text=True, check=True)
        return float(out.stdout.strip().splitlines()[-1])

    times = {arm: [] for arm in ARMS}
    for _ in range(args.rounds):
        with tempfile.TemporaryDirectory(prefix="pact-qnn-cache-") as cache:
            times["cold"].append(run(cache))  # fills the cache
            times["warm"].append(run(cache))
            times["warm_dup"].append(run(cache))
    med = {arm: statistics.median(t) for arm, t in times.items()}
    print(
        json.dumps(
            {
                "bench": "qnn_cache",
                "soc_model": args.soc_model,
                "rounds": args.rounds,
                **{f"{arm}_start_s": round(s, 3) for arm, s in med.items()},
                "warm_vs_cold": round(med["warm"] / med["cold"], 3),
                "noise_ratio": round(med["warm_dup"] / med["warm"], 3),
                "runs": {arm: [round(s, 3) for s in t] for arm, t in times.items()},
            }
        )
    )


if __name__ == "__main__":
    main()
