"""AQLoRA training speed against QLoRA and PACT all-NVFP4, under the published timing rules.

The rules (AQLoRA abstract, FACTS.md): (1) every arm trains for a fixed measurement DURATION, not a fixed step count,
and reports steps/s; (2) one arm runs twice per session (`qlora_nf4_dup`): its ratio to `qlora_nf4` is the noise
floor; (3) whole sessions are repeated (arm order shuffled per session) and results are the mean +/- sd of the
per-session speed ratios, so the spread is between sessions, not within one. Every arm runs in a fresh process.

Arms: peft fp32 LoRA, peft bf16 LoRA, peft + bitsandbytes QLoRA (nf4, computing in `--dtype` and holding everything
else in it too: the well-tuned baseline, without `prepare_model_for_kbit_training`'s fp32 upcast of embeddings and
lm_head), PACT
all-NVFP4, AQLoRA quality (`PactConfig(protect_fraction=0.2, adapt="quality")`) and AQLoRA speed
(`adapt="speed"`; the harness also calls `stop_backward_below` on it). Models: SmolLM2-135M (real weights) and the
Qwen2.5-0.5B architecture with random weights (speed only; saved once to the cache so every arm, QLoRA included,
loads the same weights). Batch 4 x 512, r=16 on all linears, AdamW on the adapters. Every arm but fp32 LoRA computes in
`--dtype` (default auto: bf16 where the CPU computes it natively, else fp32, as `pact finetune` picks); the two peft
LoRA arms compute in the dtype their names say.

    python benchmarks/aqlora_timing.py                       # 3 sessions x 2 models x 7 arms x 60 s: ~1 h 15
    python benchmarks/aqlora_timing.py --quick --seconds 5   # tiny sizes: checks the machinery, not the speed
    python benchmarks/aqlora_timing.py --ranking             # ranking time and protected layers, no training

Run it on a quiet machine. Progress goes to stderr; stdout gets ONE JSON line at the end.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # common and protection_controls, beside this script
from common import cpu_model, log, model_folder  # noqa: E402

from optimum_pact.precision.compute_dtype import DTYPES  # noqa: E402

ARMS = ("lora_fp32", "lora_bf16", "qlora_nf4", "pact", "aqlora_quality", "aqlora_speed")
DUPLICATE = "qlora_nf4"  # measured twice per session: the noise floor
AQLORA_ARMS = ("aqlora_quality", "aqlora_speed")
TARGETS = {("aqlora_speed", "qlora_nf4"): 0.15, ("aqlora_quality", "qlora_nf4"): 0.06}  # issue 5: >= 15% / >= 6%
COMPARISONS = [
    ("aqlora_speed", "qlora_nf4"),
    ("aqlora_quality", "qlora_nf4"),
    ("aqlora_speed", "pact"),
    ("aqlora_quality", "pact"),
    ("pact", "qlora_nf4"),
    ("lora_bf16", "qlora_nf4"),
    ("lora_fp32", "qlora_nf4"),
    ("qlora_nf4_dup", "qlora_nf4"),  # the noise floor
]
MODELS = ("smollm2", "qwen2.5-0.5b")


def aqlora_available() -> bool:
    """True once PactConfig has the AQLoRA fields (issue 5 wiring)."""
    from peft_ext import PactConfig

    return "protect_fraction" in PactConfig.__dataclass_fields__


def build(
    arm: str, path: str, r: int, protect_fraction: float, adapt_top_blocks: int | None, dtype_name: str = "auto"
):
    """The model of one arm, adapters attached and trainable; the arms not named by a dtype compute in `dtype_name`."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from optimum_pact.precision import resolve_dtype
    from peft_ext import PactConfig

    lora = dict(r=r, lora_alpha=2 * r, target_modules="all-linear", task_type="CAUSAL_LM")
    named = {"lora_fp32": torch.float32, "lora_bf16": torch.bfloat16}
    dtype = named.get(arm) or resolve_dtype(dtype_name)
    if arm == "qlora_nf4":
        from transformers import BitsAndBytesConfig

        quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, quantization_config=quant)
        return get_peft_model(model, LoraConfig(**lora))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    if arm in ("lora_fp32", "lora_bf16"):
        return get_peft_model(model, LoraConfig(**lora))
    if arm == "pact":
        return get_peft_model(model, PactConfig(**lora))
    adapt = arm.removeprefix("aqlora_")
    extra = {"adapt_top_blocks": adapt_top_blocks} if adapt == "speed" else {}
    model = get_peft_model(model, PactConfig(**lora, protect_fraction=protect_fraction, adapt=adapt, **extra))
    if adapt == "speed":
        from peft_ext.backward_stop import stop_backward_below
        from peft_ext.blocks import lowest_trainable_block

        stop_backward_below(model, lowest_trainable_block(model))  # idempotent if the wiring already did it
    return model


def layer_counts(model) -> dict:
    """What the arm really built: frozen NVFP4 vs dense linears in the blocks, the lowest adapted block."""
    from torch import nn

    from optimum_pact.dataflow import FrozenLinear
    from peft_ext.blocks import block_index, lowest_trainable_block

    modules = [(n, m) for n, m in model.named_modules() if block_index(n) is not None and "lora_" not in n]
    frozen = [m for _, m in modules if isinstance(m, FrozenLinear) and getattr(m, "precision", "nvfp4") == "nvfp4"]
    counts = {
        "nvfp4_linears": len(frozen),
        "other_frozen_linears": sum(isinstance(m, FrozenLinear) for _, m in modules) - len(frozen),
        "dense_linears": sum(type(m) is nn.Linear for _, m in modules),
        "bnb_4bit_linears": sum(type(m).__name__ == "Linear4bit" for _, m in modules),
        "lowest_adapted_block": lowest_trainable_block(model),
        "trainable_params": sum(p.numel() for p in model.parameters() if p.requires_grad),
    }
    protected = getattr(model.peft_config["default"], "protected_modules", None)
    if protected is not None:  # an AQLoRA arm: exactly the protected layers may be 16-bit
        counts["protected"] = len(protected)
        sixteen_bit = counts["dense_linears"] + counts["other_frozen_linears"]
        if sixteen_bit != len(protected):
            counts["warning"] = (
                f"{sixteen_bit} decoder linears are 16-bit but {len(protected)} are protected: not the AQLoRA "
                "recipe (unadapted layers left unquantized? see peft_ext.blocks.quantize_unadapted)"
            )
            log(f"WARNING: {counts['warning']}")
    return counts


def run_arm(arm: str, path: str, args) -> dict:
    """Build one arm, warm up, then train for `args.seconds` of wall clock; steps/s over whole steps."""
    import torch

    from trainer_callbacks.resources import peak_rss_bytes

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = build(arm.removesuffix("_dup"), path, args.r, args.protect_fraction, args.adapt_top_blocks, args.dtype)
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))

    def step() -> float:
        start = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    for _ in range(args.warmup):
        step()
    times, start = [], time.perf_counter()
    while not times or time.perf_counter() - start < args.seconds:
        times.append(step())
    elapsed = time.perf_counter() - start
    return {"arm": arm, "steps": len(times), "elapsed_s": elapsed, "steps_per_s": len(times) / elapsed,
            "step_s": times, "peak_rss_gib": peak_rss_bytes() / 2**30, "threads": torch.get_num_threads(),
            "dtype": str(next(p for p in model.parameters() if p.requires_grad).dtype).removeprefix("torch."),
            **layer_counts(model)}  # fmt: skip


def session(index: int, key: str, path: str, arms: list[str], args) -> dict:
    """One session: every arm (plus the duplicate) once, in a shuffled order, each in a fresh process."""
    order = [*arms, f"{DUPLICATE}_dup"] if DUPLICATE in arms else list(arms)
    random.Random(args.seed * 1000 + index).shuffle(order)
    results = {}
    for arm in order:
        cmd = [sys.executable, __file__, "--arm", arm, "--model-path", path] + child_args(args)
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode:
            tail = "\n".join(proc.stderr.strip().splitlines()[-3:])
            log(f"  session {index + 1} {key} {arm}: FAILED\n{tail}")
            results[arm] = {"arm": arm, "error": tail}
            continue
        results[arm] = json.loads(proc.stdout.strip().splitlines()[-1])
        res = results[arm]
        log(f"  session {index + 1} {key} {arm:>15}: {res['steps_per_s']:.3f} steps/s ({res['steps']} steps), "
            f"peak {res['peak_rss_gib']:.2f} GiB, linears: nvfp4 {res['nvfp4_linears']}, "
            f"bnb {res['bnb_4bit_linears']}, dense {res['dense_linears']}, "
            f"lowest adapted block {res['lowest_adapted_block']}")  # fmt: skip
    return results


def child_args(args) -> list[str]:
    out = ["--seconds", str(args.seconds), "--warmup", str(args.warmup), "--batch", str(args.batch)]
    out += ["--seq", str(args.seq), "--r", str(args.r), "--protect-fraction", str(args.protect_fraction)]
    out += ["--dtype", args.dtype]
    if args.adapt_top_blocks is not None:
        out += ["--adapt-top-blocks", str(args.adapt_top_blocks)]
    if args.threads:
        out += ["--threads", str(args.threads)]
    return out


def summarize(sessions: list[dict]) -> dict:
    """Mean +/- sd over sessions of each speed gain (steps/s ratio - 1), and how many beat that session's noise."""
    out = {}
    for arm, ref in COMPARISONS:
        gains, noise = [], []
        for res in sessions:
            if all("steps_per_s" in res.get(a, {}) for a in (arm, ref)):
                gains.append(res[arm]["steps_per_s"] / res[ref]["steps_per_s"] - 1)
                dup = res.get(f"{DUPLICATE}_dup", {})
                if "steps_per_s" in dup and "steps_per_s" in res.get(DUPLICATE, {}):
                    noise.append(abs(dup["steps_per_s"] / res[DUPLICATE]["steps_per_s"] - 1))
        if not gains:
            continue
        entry = {"mean": statistics.mean(gains), "sd": statistics.stdev(gains) if len(gains) > 1 else None,
                 "min": min(gains), "max": max(gains), "sessions": gains}  # fmt: skip
        if len(noise) == len(gains) and not arm.endswith("_dup"):
            entry["sessions_above_noise"] = sum(abs(g) > n for g, n in zip(gains, noise))
        if (arm, ref) in TARGETS:
            entry["target"] = TARGETS[(arm, ref)]
            entry["target_met"] = entry["mean"] >= TARGETS[(arm, ref)]
        out[f"{arm}_vs_{ref}"] = entry
    return out


def ranking_report(keys: list[str], quick: bool, protect_fraction: float, repeats: int = 3) -> dict:
    """Ranking time (nf4, nvfp4), the protected layers, their premium and the memory-matched random control."""
    import torch
    from protection_controls import matched_random_protected, protection_premium_mib
    from transformers import AutoModelForCausalLM

    from peft_ext.blocks import decoder_linears, num_blocks
    from peft_ext.ranking import RANK_BY, choose_protected, rank_layers

    out = {}
    for key in keys:
        model = AutoModelForCausalLM.from_pretrained(model_folder(key, quick), dtype=torch.bfloat16)
        linears = decoder_linears(model)
        numel = {name: layer.weight.numel() for name, layer in linears.items()}
        entry = {"linears": len(linears), "blocks": num_blocks(model)}
        for rank_by in RANK_BY:
            walls, cpus = [], []
            for _ in range(repeats):  # shared machines stall whole passes: keep every time, report the best
                start, cpu = time.perf_counter(), time.process_time()
                ranking = rank_layers(model, rank_by)
                walls.append(time.perf_counter() - start)
                cpus.append(time.process_time() - cpu)
            seconds, cpu = min(walls), min(cpus)
            chosen = choose_protected(ranking, protect_fraction)
            control = matched_random_protected(model, chosen, seed=0)
            entry[rank_by] = {
                "seconds": seconds,
                "cpu_seconds": cpu,
                "all_seconds": walls,
                "threads": torch.get_num_threads(),
                "protected": chosen,
                "errors": dict(ranking[: len(chosen) + 3]),
                "premium_mib": protection_premium_mib(model, chosen),
                # the share of frozen-product work that skips dequantization: what protection can buy in time
                "protected_weight_share": sum(numel[n] for n in chosen) / sum(numel.values()),
                "matched_random_control": control,
            }
            log(
                f"{key} {rank_by}: ranked {entry['linears']} linears in {seconds:.2f} s (best of {repeats}; "
                f"{cpu:.2f} s CPU); protect {len(chosen)}, premium {entry[rank_by]['premium_mib']:.1f} MiB"
            )
        entry["nf4_nvfp4_overlap"] = len(set(entry["nf4"]["protected"]) & set(entry["nvfp4"]["protected"]))
        out[key] = entry
        del model
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arm", help=argparse.SUPPRESS)  # internal: run one arm in this process
    parser.add_argument("--model-path", help=argparse.SUPPRESS)
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    parser.add_argument("--seconds", type=float, default=60.0, help="measurement duration per arm, after warm-up")
    parser.add_argument("--warmup", type=int, default=2, help="steps before the clock starts")
    parser.add_argument("--sessions", type=int, default=3)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--r", type=int, default=16)
    parser.add_argument("--protect-fraction", type=float, default=0.2)
    parser.add_argument("--adapt-top-blocks", type=int, default=None, help="speed arm; default: PactConfig's")
    parser.add_argument("--threads", type=int, default=None, help="torch threads per arm (default: torch's)")
    parser.add_argument("--dtype", choices=DTYPES, default="auto",
                        help="compute dtype of the arms not named by one (auto: bf16 where the CPU has it natively, "
                        "else fp32, as training picks)")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0, help="seeds the arm order of each session")
    parser.add_argument("--quick", action="store_true", help="batch 1 x 32 tokens and a tiny Qwen2 (machinery only)")
    parser.add_argument("--ranking", action="store_true", help="only time the ranking and list the protected layers")
    args = parser.parse_args()
    if args.quick:
        args.batch, args.seq, args.warmup = 1, 32, 1
    if args.arm:
        print(json.dumps(run_arm(args.arm, args.model_path, args)))
        return
    if args.ranking:
        report = ranking_report(args.models, args.quick, args.protect_fraction)
        print(json.dumps({"bench": "aqlora_ranking", "quick": args.quick, "models": report}))
        return

    arms = list(args.arms)
    skipped = [a for a in arms if a in AQLORA_ARMS] if not aqlora_available() else []
    if skipped:
        log(f"PactConfig has no `protect_fraction` field yet (issue 5 wiring pending): skipping {', '.join(skipped)}")
        arms = [a for a in arms if a not in skipped]
    report = {}
    for key in args.models:
        path = model_folder(key, args.quick)
        sessions = []
        for index in range(args.sessions):
            log(f"{key}: session {index + 1}/{args.sessions}")
            sessions.append(session(index, key, path, arms, args))
        report[key] = {"ratios": summarize(sessions), "sessions": sessions}
        for name, entry in report[key]["ratios"].items():
            sd = f"{entry['sd']:.1%}" if entry["sd"] is not None else "n/a"
            met = (
                f"  target {entry['target']:+.0%}: {'met' if entry['target_met'] else 'NOT met'}"
                if "target" in entry
                else ""
            )
            log(f"{key} {name:>32}: {entry['mean']:+.1%} +/- {sd} over {len(entry['sessions'])} sessions{met}")
    config = {k: getattr(args, k) for k in ("seconds", "warmup", "sessions", "batch", "seq", "r", "protect_fraction",
                                            "adapt_top_blocks", "dtype", "quick")}  # fmt: skip
    print(
        json.dumps({"bench": "aqlora_timing", **config, "cpu": cpu_model(), "skipped_arms": skipped, "models": report})
    )


if __name__ == "__main__":
    main()
