"""One whole LoRA training step, one fresh process per arm, arms interleaved over several sessions.

Arms (`--dtype` is the compute dtype of every arm but lora_fp32; bf16 by default):
  lora            peft LoRA, stock                   lora_dup      the same again: its ratio is the noise floor
  lora_compile    peft LoRA with the norms and gated activations compiled (optimum_pact.fuse_cpu_ops: the peer
                  given the same fusion)
  lora_pinned     peft LoRA with glibc's mmap threshold pinned (optimum_pact.pin_mmap_threshold: the peer given the
                  same allocator setting)
  qlora_nf4       peft + bitsandbytes nf4             lora_fp32     peft LoRA in fp32 (the accuracy reference)
  pact            PactConfig, glibc's own malloc policy                    pact_fused    pact + fuse_cpu_ops
  pact_pinned     pact with glibc's mmap threshold pinned at 4 MiB (pact_mmap_threshold)
  pact_trimmed    pact with PactTrainer's default pact_trim_heap: glibc's free heap handed back after the first step
                  and whenever the resident set grows past it (optimum_pact.HeapTrimmer)
  pact_main       what `pact finetune` trains with: the base read as the main job reads it (the packed cache, AQLoRA's
                  quarter kept 16-bit, ranked by NVFP4 error), the 'logits' memory saver, pact_trim_heap
  pact_exact      pact_main with the 'exact' savers (block checkpointing, offloaded block inputs, mapped weights)
Every arm: r=16 on all linears, AdamW on the adapter, forward + backward + optimizer step, one warm-up step (it also
pays the compile arms' compile time) then `--steps` timed ones. Per arm: median step time and the process's peak RSS
(VmHWM, mapped pages included). Sizes: `smollm2` (SmolLM2-135M, real weights, batch 4 x 512) and `qwen2.5-0.5b`
(its published architecture, random weights, batch 2 x 512). Each session runs every arm once, in a rotated order;
every ratio is given per session, as the median over sessions, and beside the noise floor (lora_dup / lora) of the
same sessions. The last line is JSON.

    python benchmarks/bench_train_step.py [--size smollm2] [--sessions 3] [--steps 2] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import cpu_model, model_folder  # lscpu's model and AMX; SmolLM2 or the Qwen2.5 architecture

ARMS = (
    "lora", "lora_dup", "lora_compile", "lora_pinned", "qlora_nf4", "lora_fp32", "pact", "pact_fused",
    "pact_pinned", "pact_trimmed", "pact_main", "pact_exact",
)  # fmt: skip
# the arms built as `pact finetune` builds its model: the memory savers each runs (pact_main: the main job's own)
SAVERS = {"pact_main": None, "pact_exact": "exact"}
SIZES = {"smollm2": 4, "qwen2.5-0.5b": 2}  # model_folder key: default batch
RATIOS = {  # name: (arm, over arm)
    "pact_vs_lora": ("pact", "lora"),
    "pact_fused_vs_lora": ("pact_fused", "lora"),
    "pact_fused_vs_lora_compile": ("pact_fused", "lora_compile"),
    "pact_vs_lora_compile": ("pact", "lora_compile"),
    "pact_vs_lora_pinned": ("pact", "lora_pinned"),
    "pact_pinned_vs_lora": ("pact_pinned", "lora"),
    "pact_trimmed_vs_lora": ("pact_trimmed", "lora"),
    "lora_pinned_vs_lora": ("lora_pinned", "lora"),
    "pact_vs_qlora": ("pact", "qlora_nf4"),
    "pact_main_vs_lora": ("pact_main", "lora"),
    "pact_exact_vs_lora": ("pact_exact", "lora"),
    "pact_vs_lora_fp32": ("pact", "lora_fp32"),
    "lora_compile_vs_lora": ("lora_compile", "lora"),
    "noise_dup_vs_lora": ("lora_dup", "lora"),
}


def build(arm: str, model_path: str, r: int, dtype_name: str):
    """The model of one arm with its adapters trainable, and the arm's help (compile, allocator) applied."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from optimum_pact import fuse_cpu_ops, pin_mmap_threshold
    from peft_ext import PactConfig

    lora = dict(r=r, lora_alpha=2 * r, target_modules="all-linear", task_type="CAUSAL_LM")
    dtype = torch.float32 if arm == "lora_fp32" else getattr(torch, dtype_name)
    if arm in ("pact_pinned", "lora_pinned"):
        pin_mmap_threshold()  # PactTrainer's pact_mmap_threshold=4 MiB
    if arm == "qlora_nf4":
        from peft import prepare_model_for_kbit_training
        from transformers import BitsAndBytesConfig

        quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype)
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, quantization_config=quant)
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
        return get_peft_model(model, LoraConfig(**lora))
    if arm in SAVERS:
        from optimum_pact.commands.arguments import MAIN_JOB_DEFAULTS
        from optimum_pact.commands.streamed_base import load_streamed_base

        job = MAIN_JOB_DEFAULTS
        config = PactConfig(**lora, protect_fraction=job["pact_protect_fraction"], rank_by=job["pact_rank_by"])
        base, config = load_streamed_base(config, model_path, None, getattr(torch, dtype_name))
        return get_peft_model(base, config)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
    model = get_peft_model(model, (PactConfig if arm.startswith("pact") else LoraConfig)(**lora))
    if arm in ("lora_compile", "pact_fused"):
        fuse_cpu_ops(model)
    return model


def run_arm(arm: str, model_path: str, steps: int, batch: int, seq: int, r: int, dtype_name: str) -> dict:
    import torch

    from trainer_callbacks.resources import peak_rss_bytes

    torch.manual_seed(0)
    model = build(arm, model_path, r, dtype_name)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq))
    times = []
    from optimum_pact.memory import HeapTrimmer

    trim = HeapTrimmer() if arm in ("pact_trimmed", *SAVERS) else None  # as PactTrainer's pact_trim_heap does
    if arm in SAVERS:
        from optimum_pact.commands.arguments import MAIN_JOB_DEFAULTS
        from optimum_pact.memory import enable_memory_savers

        enable_memory_savers(model, SAVERS[arm] or MAIN_JOB_DEFAULTS["pact_memory_saver"])  # closed with the process
    for i in range(steps + 1):  # the first step warms up (and compiles)
        start = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if trim is not None:
            trim()
        if i:
            times.append(time.perf_counter() - start)
    return {"arm": arm, "step_s": statistics.median(times), "steps_s": times, "peak_rss_gib": peak_rss_bytes() / 2**30}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arm", choices=ARMS, help=argparse.SUPPRESS)  # internal: run one arm in this process
    parser.add_argument("--model", help="model folder (default: the --size model)")
    parser.add_argument("--size", choices=SIZES, default="smollm2")
    parser.add_argument("--arms", default=",".join(ARMS), help="comma-separated subset of: " + ", ".join(ARMS))
    parser.add_argument("--sessions", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2, help="timed steps per arm and session (after one warm-up)")
    parser.add_argument("--batch", type=int, help="default: 4 for smollm2, 2 for qwen2.5-0.5b")
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--r", type=int, default=16)
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--output", help="a folder: also write the results there (results.json)")
    args = parser.parse_args()
    args.batch = args.batch or SIZES[args.size]
    size = None if args.model else args.size  # what the results name: --size's model, or the --model folder given
    args.model = args.model or model_folder(args.size, quick=False)
    if args.arm:
        if args.threads:
            import torch

            torch.set_num_threads(args.threads)
        print(json.dumps(run_arm(args.arm, args.model, args.steps, args.batch, args.seq, args.r, args.dtype)))
        return

    arms = [a for a in args.arms.split(",") if a]
    if unknown := set(arms) - set(ARMS):
        parser.error(f"--arms: unknown {sorted(unknown)}; choose from {', '.join(ARMS)}")
    sessions, failed = [], {}
    for s in range(args.sessions):
        order = arms[s % len(arms) :] + arms[: s % len(arms)]  # rotated: no arm always runs first or last
        session = {}
        for arm in order:
            cmd = [sys.executable, __file__, "--arm", arm, "--model", args.model, "--steps", str(args.steps)]
            cmd += ["--batch", str(args.batch), "--seq", str(args.seq), "--r", str(args.r), "--dtype", args.dtype]
            cmd += ["--threads", str(args.threads)] if args.threads else []
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:  # e.g. -9: the kernel's OOM killer (see dmesg); the other arms still run
                why = f"exit status {done.returncode}" + (" (SIGKILL: out of memory?)" * (done.returncode == -9))
                failed.setdefault(arm, []).append(why)
                print(f"session {s}: {arm:>13} failed: {why}\n{done.stderr[-2000:]}", file=sys.stderr, flush=True)
                continue
            session[arm] = json.loads(done.stdout.strip().splitlines()[-1])
            res = session[arm]
            print(f"session {s}: {arm:>13} {res['step_s']:.2f} s/step, peak RSS {res['peak_rss_gib']:.2f} GiB",
                  file=sys.stderr, flush=True)  # fmt: skip
        sessions.append(session)
    arms = [a for a in arms if all(a in sess for sess in sessions)]  # an arm that failed in a session is left out
    step = {a: statistics.median(sess[a]["step_s"] for sess in sessions) for a in arms}
    rss = {a: statistics.median(sess[a]["peak_rss_gib"] for sess in sessions) for a in arms}
    ratios = {}
    for name, (num, den) in RATIOS.items():
        if num in arms and den in arms:
            per = [sess[num]["step_s"] / sess[den]["step_s"] for sess in sessions]
            ratios[name] = {"median": statistics.median(per), "min": min(per), "max": max(per), "sessions": per}
    noise = ratios.get("noise_dup_vs_lora", {}).get("median")
    rss_ratios = {f"{a}_rss_vs_lora": rss[a] / rss["lora"] for a in arms if a != "lora" and "lora" in arms}
    config = {"size": size, "model": args.model,
              "batch": args.batch, "seq": args.seq, "r": args.r, "dtype": args.dtype,
              "steps": args.steps, "sessions": args.sessions, "cpu": cpu_model(),
              "date": time.strftime("%Y-%m-%d"), "arms": arms}  # fmt: skip
    for name, ratio in ratios.items():
        beside = f"; noise {noise:.3f}" if noise else ""
        print(f"{name:>28}: {ratio['median']:.3f} (sessions {ratio['min']:.3f}-{ratio['max']:.3f}){beside}")
    line = {"bench": "train_step", **config, "step_s": step, "peak_rss_gib": rss, "ratios": ratios, "failed": failed,
            "noise_dup_vs_lora": noise, "rss_ratios": rss_ratios, "per_session": sessions}  # fmt: skip
    if args.output:
        out = Path(args.output) / "results.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(line, indent=1) + "\n")
    print(json.dumps(line))


if __name__ == "__main__":
    main()
