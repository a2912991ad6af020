"""Fused CPU side: does compiling the step's remaining CPU operators pay on this CPU? One fresh process per arm.

The PACT step of SmolLM2-135M (real weights, bf16 or `--dtype float32`, batch 4 x seq 512, r=16 on all linears,
torch backend) with its CPU operators eager vs fused by `optimum_pact.fuse_cpu_ops` (what `pact_fuse_cpu_ops` runs:
torch.compile, inductor's C++ codegen): every RMSNorm (upcast, mean of squares, rsqrt, scale, downcast: five kernels
-> one) and every MLP activation `act(gate) * up` (two -> one), forward and backward; the compile time is printed.
The frozen products and attention (SDPA, already fused) are untouched. Arms run interleaved as fresh processes, eager
twice (noise floor). Prints one JSON line: median step times and the ratio fused / eager.

    python benchmarks/bench_fused_cpu.py [--steps 3] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

ARMS = ("eager", "fused", "eager_dup")


def run_arm(arm: str, steps: int, batch: int, seq: int, dtype: str = "bfloat16") -> dict:
    import torch
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from optimum_pact import fuse_cpu_ops
    from optimum_pact.commands.default_model import ensure_default_model
    from peft_ext import PactConfig

    torch.set_num_threads(2)
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(str(ensure_default_model()), dtype=getattr(torch, dtype))
    model = get_peft_model(base, PactConfig(r=16, lora_alpha=32, target_modules="all-linear"))
    fused = fuse_cpu_ops(model) if arm == "fused" else None
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq))
    times = []
    for i in range(steps + 1):  # the first step warms up (and compiles)
        start = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        if i:
            times.append(time.perf_counter() - start)
    compile_s = round(fused.compile_seconds(), 2) if fused is not None else 0.0
    return {
        "arm": arm,
        "step_s": statistics.median(times),
        "fused_modules": fused.modules if fused else 0,
        "compile_s": compile_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--arm", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.arm:
        print(json.dumps(run_arm(args.arm, args.steps, args.batch, args.seq, args.dtype)))
        return
    times, compile_s = {arm: [] for arm in ARMS}, []
    for _ in range(args.rounds):
        for arm in ARMS:
            cmd = [sys.executable, __file__, "--arm", arm, "--steps", str(args.steps)]
            cmd += ["--batch", str(args.batch), "--seq", str(args.seq), "--dtype", args.dtype]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            result = json.loads(out.strip().splitlines()[-1])
            times[arm].append(result["step_s"])
            if arm == "fused":
                compile_s.append(result["compile_s"])
    med = {arm: statistics.median(t) for arm, t in times.items()}
    print(
        json.dumps(
            {
                "bench": "fused_cpu",
                "dtype": args.dtype,
                **{f"{arm}_step_s": round(t, 3) for arm, t in med.items()},
                "fused_vs_eager": round(med["fused"] / med["eager"], 3),
                "noise_ratio": round(med["eager_dup"] / med["eager"], 3),
                "fused_compile_s": compile_s,
                "runs": times,
            }
        )
    )


if __name__ == "__main__":
    main()
