"""Frozen-weight products on CPU: forward + input gradient of one linear, dense vs bitsandbytes nf4 vs PACT NVFP4.

Each step is `y = layer(x); y.backward(g)` with `x.requires_grad` and a frozen weight (no weight gradient).
`pact_fp32` is the PACT layer fed fp32 activations, its ratio taken to dense fp32: the comparison that matters on a
CPU without native bf16 (AVX2), where torch emulates the bf16 products.
Arms run interleaved (every round visits every shape, token count and arm, in a random order) so machine noise and
cache effects hit all arms alike; each number is the median over rounds. `bf16_dup` is dense bf16 a second time: its
ratio to `bf16` is the noise floor. Also times the dequantization of each weight (native kernel, torch path, bnb nf4).
Timings on a shared machine swing widely: compare runs by their ratios, and repeat.

    python benchmarks/bench_frozen_products.py            # a few minutes
    python benchmarks/bench_frozen_products.py --quick    # under a minute
    python benchmarks/bench_frozen_products.py --tiles 256,1024   # extra PACT arms with those tile sizes
    python benchmarks/bench_frozen_products.py --fp32   # fp32 arms only: a CPU without native bf16

Progress goes to stderr; stdout gets ONE JSON line at the end.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import random
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from common import cpu_model
from torch import nn

from optimum_pact.backends import get_backend
from optimum_pact.dataflow.linear import FrozenLinear
from optimum_pact.nvfp4 import kernels

SHAPES = [(576, 1536), (1536, 576), (896, 4864), (4864, 896)]  # (in_features, out_features): SmolLM2, Qwen2.5-0.5B
TOKENS = [512, 4096]
TARGETS = {512: 1.10, 4096: 1.05}  # PACT / dense (bf16; fp32 with --fp32): issue 15


def log(*args) -> None:
    print(*args, file=sys.stderr, flush=True)


def bnb_linear(weight: torch.Tensor):
    import bitsandbytes as bnb

    n, k = weight.shape
    layer = bnb.nn.Linear4bit(k, n, bias=False, compute_dtype=torch.bfloat16, quant_type="nf4")
    layer.weight = bnb.nn.Params4bit(weight.clone(), requires_grad=False, quant_type="nf4")
    layer = layer.to("cpu")  # quantizes; stays in train mode: eval() + no_grad repacks the weight in place
    assert layer.weight.bnb_quantized
    return layer


def make_config(k: int, n: int, tokens: int, tiles: list[int], fp32: bool = False) -> dict:
    torch.manual_seed(k * 7 + n)
    linear = nn.Linear(k, n, bias=False)
    w32 = linear.weight.detach()
    pact = FrozenLinear.from_linear(linear)
    if fp32:  # where bf16 is emulated: PACT fed fp32 against dense fp32, and dense fp32 twice for the noise floor
        w32_dup = w32.clone()
        arms = {
            "fp32": (torch.float32, lambda x: F.linear(x, w32)),
            "pact_fp32": (torch.float32, pact),
            "fp32_dup": (torch.float32, lambda x: F.linear(x, w32_dup)),
        }
    else:
        wb, wb_dup = w32.bfloat16(), w32.bfloat16().clone()
        arms = {
            "fp32": (torch.float32, lambda x: F.linear(x, w32)),
            "bf16": (torch.bfloat16, lambda x: F.linear(x, wb)),
            "bnb_nf4": (torch.bfloat16, bnb_linear(w32)),
            "pact": (torch.bfloat16, pact),
            "pact_fp32": (torch.float32, pact),  # the same layer fed fp32 activations
            "bf16_dup": (torch.bfloat16, lambda x: F.linear(x, wb_dup)),
        }
    for tile in tiles:
        tiled = get_backend("torch", tile_size=tile)
        tile_dtype = torch.float32 if fp32 else torch.bfloat16
        arms[f"pact_tile{tile}"] = (tile_dtype, FrozenLinear.from_linear(linear, backend=tiled))
    x32, g32 = torch.randn(tokens, k), torch.randn(tokens, n)
    inputs = {dt: (x32.to(dt, copy=True).requires_grad_(), g32.to(dt)) for dt in (torch.float32, torch.bfloat16)}
    return {"k": k, "n": n, "tokens": tokens, "arms": arms, "inputs": inputs, "times": {a: [] for a in arms}}


def step(config: dict, arm: str) -> torch.Tensor:
    dtype, layer = config["arms"][arm]
    x, g = config["inputs"][dtype]
    x.grad = None
    layer(x).backward(g)
    return x.grad


def check(config: dict) -> None:
    """Sanity: every arm computes the same input gradient up to its quantization error."""
    ref = step(config, "fp32").clone()
    for arm in config["arms"]:
        err = (step(config, arm).float() - ref).norm() / ref.norm()
        assert err < 0.2, f"{arm} input gradient is off by {err:.3f} (relative)"


def time_dequant(rounds: int) -> list[dict]:
    """Median ms to dequantize each weight to bf16: native C kernel, pure-torch path, bnb dequantize_4bit."""
    import bitsandbytes.functional as bnbf

    from optimum_pact.nvfp4 import quantize

    rows = []
    for k, n in SHAPES:
        w = torch.randn(n, k)
        q, l4 = quantize(w), bnb_linear(w)
        fns = {"torch": lambda q=q: kernels.dequantize_torch(q.qdata, q.scale, q.scale_2, torch.bfloat16)}
        if kernels.native_available():
            fns["native"] = lambda q=q: kernels.dequantize_native(q.qdata, q.scale, q.scale_2, torch.bfloat16)
        fns["bnb_nf4"] = lambda l4=l4: bnbf.dequantize_4bit(l4.weight.data, l4.weight.quant_state)
        times = {name: [] for name in fns}
        for fn in fns.values():
            fn(), fn()
        for _ in range(rounds * 4):
            for name, fn in fns.items():
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
        rows.append({"in": k, "out": n, **{f"{a}_ms": round(statistics.median(t) * 1e3, 3) for a, t in times.items()}})
        log(f"dequant {n}x{k}: " + ", ".join(f"{a} {statistics.median(t) * 1e3:.3f} ms" for a, t in times.items()))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 rounds instead of --rounds")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tiles", default="", help="comma-separated tile sizes for extra PACT arms")
    parser.add_argument("--fp32", action="store_true", help="fp32 arms only (PACT, dense, dense again): for CPUs "
                        "without native bf16, where the bf16 and bnb arms take many minutes")  # fmt: skip
    args = parser.parse_args()
    rounds = 3 if args.quick else args.rounds
    tiles = [int(t) for t in args.tiles.split(",") if t]
    torch.set_num_threads(args.threads)
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    start, load_start = time.perf_counter(), os.getloadavg()[0]

    configs = [make_config(k, n, t, tiles, args.fp32) for t in TOKENS for k, n in SHAPES]
    for config in configs:
        check(config)
        for arm in config["arms"]:  # warmup (check() already ran each arm twice)
            step(config, arm)
    arm_names, rng = list(configs[0]["arms"]), random.Random(0)
    for r in range(rounds):
        for config in configs:
            order = rng.sample(arm_names, len(arm_names))  # a fresh order each time: no arm always follows fp32
            reps = max(1, 2048 // config["tokens"])  # short steps are averaged over a few calls
            for arm in order:
                t0 = time.perf_counter()
                for _ in range(reps):
                    step(config, arm)
                config["times"][arm].append((time.perf_counter() - t0) / reps)
        log(f"round {r + 1}/{rounds} done ({time.perf_counter() - start:.0f} s)")

    base = "fp32" if args.fp32 else "bf16"  # what PACT is compared with
    results, worst = [], {f"{base}_512": 0.0, f"{base}_4096": 0.0, "bnb": 0.0}
    for c in configs:
        ms = {arm: statistics.median(t) * 1e3 for arm, t in c["times"].items()}
        if args.fp32:
            ratio = {"pact_fp32/fp32": ms["pact_fp32"] / ms["fp32"], "dup/fp32": ms["fp32_dup"] / ms["fp32"]}
        else:
            ratio = {
                "pact/bf16": ms["pact"] / ms["bf16"],
                "bnb/bf16": ms["bnb_nf4"] / ms["bf16"],
                "pact/bnb": ms["pact"] / ms["bnb_nf4"],
                "dup/bf16": ms["bf16_dup"] / ms["bf16"],
                "pact_fp32/fp32": ms["pact_fp32"] / ms["fp32"],
            }
            worst["bnb"] = max(worst["bnb"], ratio["pact/bnb"])
        ratio.update({f"{a}/{base}": ms[a] / ms[base] for a in ms if a.startswith("pact_tile")})
        pact_ratio = ratio["pact_fp32/fp32" if args.fp32 else "pact/bf16"]
        worst[f"{base}_{c['tokens']}"] = max(worst[f"{base}_{c['tokens']}"], pact_ratio)
        results.append(
            {
                "in": c["k"],
                "out": c["n"],
                "tokens": c["tokens"],
                "ms": {a: round(v, 3) for a, v in ms.items()},
                "ratio": {a: round(v, 3) for a, v in ratio.items()},
            }
        )
        log(
            f"{c['k']:>4}->{c['n']:<4} x{c['tokens']:<4} "
            + " ".join(f"{a} {v:.2f}" for a, v in ms.items())
            + " | "
            + " ".join(f"{a} {v:.3f}" for a, v in ratio.items())
        )
    dequant = None if args.fp32 else time_dequant(rounds)  # its bnb arm is the slow one where bf16 is emulated
    targets = {
        f"pact_le_{TARGETS[512]}x_{base}_at_512": {"limit": TARGETS[512], "worst": round(worst[f"{base}_512"], 3)},
        f"pact_le_{TARGETS[4096]}x_{base}_at_4096": {"limit": TARGETS[4096], "worst": round(worst[f"{base}_4096"], 3)},
    }
    if not args.fp32:
        targets["pact_le_bnb_nf4_everywhere"] = {"limit": 1.0, "worst": round(worst["bnb"], 3)}
    for t in targets.values():
        t["pass"] = t["worst"] <= t["limit"]
    print(
        json.dumps(
            {
                "bench": "frozen_products",
                "machine": platform.processor() or platform.machine(),
                "cpu": cpu_model(),
                "threads": args.threads,
                "rounds": rounds,
                "torch": torch.__version__,
                "native_dequant": kernels.native_available(),
                "default_tile_size": configs[0]["arms"]["pact_fp32"][1].backend.tile_size,
                "compared_with": base,
                "results": results,
                "dequant_bf16": dequant,
                "targets": targets,
                "all_pass": all(t["pass"] for t in targets.values()),
                "wall_s": round(time.perf_counter() - start, 1),
                "loadavg_1min": [round(load_start, 2), round(os.getloadavg()[0], 2)],  # other work on the machine
                "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
            }
        )
    )


if __name__ == "__main__":
    main()
