"""One whole LoRA training step of SmolLM2-135M (real weights), one fresh process per arm.

Arms: peft fp32 LoRA, peft bf16 LoRA (twice: the second copy is the noise floor), peft + bitsandbytes QLoRA
(nf4, bf16 compute), and PACT (NVFP4 data-flow base, bf16 activations). Every arm: batch 4 x seq 512, r=16 on
all linears, AdamW on the adapter, forward + backward + optimizer step. Reports the median step time and the
process's peak RSS (VmHWM), and prints one JSON line with the ratios.

    python benchmarks/bench_train_step.py [--steps 3] [--batch 4] [--seq 512]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

ARMS = ("lora_fp32", "lora_bf16", "qlora_nf4", "pact", "lora_bf16_dup")


def build(arm: str, model_path: str, r: int):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from peft_ext import PactConfig

    lora = dict(r=r, lora_alpha=2 * r, target_modules="all-linear", task_type="CAUSAL_LM")
    dtype = torch.float32 if arm == "lora_fp32" else torch.bfloat16
    if arm != "qlora_nf4":
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
        return get_peft_model(model, (PactConfig if arm == "pact" else LoraConfig)(**lora))
    from peft import prepare_model_for_kbit_training
    from transformers import BitsAndBytesConfig

    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, quantization_config=quant)
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    return get_peft_model(model, LoraConfig(**lora))


def run_arm(arm: str, model_path: str, steps: int, batch: int, seq: int, r: int) -> dict:
    import torch

    from trainer_callbacks.resources import peak_rss_bytes

    torch.set_num_threads(2)
    torch.manual_seed(0)
    model = build(arm, model_path, r)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq))
    times = []
    for i in range(steps + 1):  # the first step warms up
        start = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i:
            times.append(time.perf_counter() - start)
    return {"arm": arm, "step_s": statistics.median(times), "steps_s": times, "peak_rss_gib": peak_rss_bytes() / 2**30}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arm", choices=ARMS, help=argparse.SUPPRESS)  # internal: run one arm in this process
    parser.add_argument("--model", help="model folder (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--r", type=int, default=16)
    args = parser.parse_args()
    if args.model is None:
        from optimum_pact.commands.default_model import ensure_default_model

        args.model = str(ensure_default_model())
    if args.arm:
        print(json.dumps(run_arm(args.arm, args.model, args.steps, args.batch, args.seq, args.r)))
        return

    results = {}
    for arm in ARMS:
        cmd = [sys.executable, __file__, "--arm", arm, "--model", args.model, "--steps", str(args.steps)]
        cmd += ["--batch", str(args.batch), "--seq", str(args.seq), "--r", str(args.r)]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        results[arm] = json.loads(out.strip().splitlines()[-1])
        print(f"{arm:>14}: {results[arm]['step_s']:.2f} s/step, peak RSS {results[arm]['peak_rss_gib']:.2f} GiB")
    step = {arm: res["step_s"] for arm, res in results.items()}
    rss = {arm: res["peak_rss_gib"] for arm, res in results.items()}
    ratios = {
        "pact_vs_bf16": step["pact"] / step["lora_bf16"],
        "pact_vs_qlora": step["pact"] / step["qlora_nf4"],
        "pact_vs_fp32": step["pact"] / step["lora_fp32"],
        "noise_dup_vs_bf16": step["lora_bf16_dup"] / step["lora_bf16"],
        "pact_rss_vs_bf16": rss["pact"] / rss["lora_bf16"],
    }
    targets = {
        "pact_le_1.05x_bf16": ratios["pact_vs_bf16"] <= 1.05,
        "pact_below_qlora": ratios["pact_vs_qlora"] < 1.0,
        "pact_rss_below_bf16": ratios["pact_rss_vs_bf16"] < 1.0,
    }
    config = {"batch": args.batch, "seq": args.seq, "r": args.r, "steps": args.steps}
    print(json.dumps({"bench": "train_step", **config, "step_s": step, "peak_rss_gib": rss, "ratios": ratios,
                      "targets_met": targets}))  # fmt: skip


if __name__ == "__main__":
    main()
