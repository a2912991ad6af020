"""Several people's adapters on one NVFP4 base: resident memory per extra adapter and the time to switch.

Trains nothing: it loads the default model (SmolLM2-135M-Instruct) on the NVFP4 base with `PactModelForCausalLM`, then
adds `--adapters` LoRA adapters (r=8 on every linear, as `pact finetune` makes them; random weights, written to a
temporary folder by a child process) one at a time, reading this process's resident memory (VmRSS, mapped pages
included) after each, and times `set_adapter` between them (twice, interleaved: the second series is the noise arm).
Prints one JSON line. The resident growth per adapter can be below the adapter's own tensor bytes (also printed): the
allocator reuses pages freed while the base loaded.

    python benchmarks/bench_adapter_swap.py --adapters 4
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from optimum_pact.commands.default_model import ensure_default_model
from optimum_pact.commands.modeling import PactModelForCausalLM

sys.path.insert(0, str(Path(__file__).parent))
from common import cpu_model, status_bytes  # noqa: E402  (lscpu's model and AMX; the /proc/self/status reader)


def save_adapters(base: Path, count: int, folder: Path) -> list[Path]:
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16)
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", init_lora_weights=False))
    paths = []
    for i in range(count):
        torch.manual_seed(i)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.normal_(0, 0.02)
        paths.append(folder / f"person{i}")
        model.save_pretrained(paths[-1])
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--switches", type=int, default=50)
    parser.add_argument("--save-to", help=argparse.SUPPRESS)  # the child process that writes the adapters
    args = parser.parse_args()
    base = ensure_default_model()
    if args.save_to:
        save_adapters(base, args.adapters, Path(args.save_to))
        return
    with tempfile.TemporaryDirectory() as tmp:  # written by a child, so this process's heap holds no freed model
        subprocess.run([sys.executable, __file__, "--adapters", str(args.adapters), "--save-to", tmp], check=True)
        paths = [Path(tmp) / f"person{i}" for i in range(args.adapters)]
        model = PactModelForCausalLM.from_pretrained(str(base))
        rss = [status_bytes("VmRSS")]
        for i, path in enumerate(paths):
            model.load_adapter(path, f"person{i}")
            rss.append(status_bytes("VmRSS"))
        weights_mib = sum(p.numel() * p.element_size() for n, p in model.model.named_parameters() if "lora_" in n)
        switch_ms, dup_ms = [], []  # the same switches timed in two interleaved series: the second is the noise arm
        for k in range(2 * args.switches):
            start = time.perf_counter()
            model.set_adapter(f"person{k // 2 % args.adapters}")
            (switch_ms if k % 2 == 0 else dup_ms).append(1000 * (time.perf_counter() - start))
    steps = [(b - a) / 2**20 for a, b in zip(rss[1:], rss[2:])]  # the first adapter also wraps the model
    print(
        json.dumps(
            {
                "bench": "adapter_swap",
                "cpu": cpu_model(),
                "machine": platform.machine(),
                "threads": torch.get_num_threads(),
                "cpus": os.cpu_count(),
                "adapters": args.adapters,
                "rss_base_mib": round(rss[0] / 2**20, 1),
                "rss_first_adapter_mib": round((rss[1] - rss[0]) / 2**20, 1),
                "rss_per_extra_adapter_mib_median": round(statistics.median(steps), 2) if steps else None,
                "adapter_weights_mib_each": round(weights_mib / 2**20 / args.adapters, 2),
                "switch_ms_median": round(statistics.median(switch_ms), 3),
                "switch_ms_max": round(max(switch_ms), 3),
                "noise_arm_ratio": round(statistics.median(dup_ms) / statistics.median(switch_ms), 3),
            }
        )
    )


if __name__ == "__main__":
    main()
