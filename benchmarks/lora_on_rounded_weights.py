"""Is a personalization gap the 4-bit weights or PACT's code? Plain peft LoRA in fp32 on base weights replaced by what
a 4-bit format reconstructs, for one user of eval_personalization's `nightly` workload, with that benchmark's batches,
seeds, LoRA init and evaluation; each run is printed beside PACT's (and fp32's, QLoRA's) saved run of the same seed.

    python benchmarks/lora_on_rounded_weights.py --user generated-6 --seeds 0 1 2 3 4 5 6 7 \\
        --results benchmarks/results/personalization/results.json

Equal accuracy and final loss to PACT's in every seed say the gap is the format (PACT computes exactly what dense
products on the reconstructed weights compute); `--format nf4` asks the same of bitsandbytes' format.
`--keep-fraction 0.2` leaves that share of the decoder linears unrounded (fp32): the ones with the largest
reconstruction error (`--keep-by error`, AQLoRA's `rank_by="nvfp4"` list), or a random list matched in shapes
(`--keep-by random`, drawn with each seed): does sparing a few layers close a gap?
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))


def main(argv=None) -> list[dict]:
    import eval_personalization as ep
    from common import round_linears
    from protection_controls import matched_random_protected
    from transformers import AutoTokenizer

    from optimum_pact.nvfp4 import SCALE_RULES, fake_quantize
    from peft_ext.ranking import choose_protected, nf4_dequantized

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--user", default="generated-6")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--format", choices=("nvfp4", "nf4"), default="nvfp4")
    parser.add_argument("--scale-rule", choices=SCALE_RULES, default=SCALE_RULES[0], help="NVFP4's block scales")
    parser.add_argument("--keep-fraction", type=float, default=0.0, help="share of decoder linears left unrounded")
    parser.add_argument("--keep-by", choices=("error", "random"), default="error")
    parser.add_argument("--results", help="eval_personalization's results.json: print its runs of each seed beside")
    args = parser.parse_args(argv)
    bench = ep.parse_args(["--dtype", "float32"])  # the benchmark's defaults: steps, batch, lr, r
    task = next((t for t in ep.build_workloads(bench)["nightly"] if t.user == args.user), None)
    if task is None:
        raise SystemExit(f"--user {args.user!r}: not a nightly user (built-in, generated-0 ... generated-10)")
    saved = {}
    if args.results:
        saved = json.loads(Path(args.results).read_text())["workloads"]["nightly"]["users"][args.user]["methods"]
    path = ep.model_path(bench)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    rounded = {"nvfp4": partial(fake_quantize, scale_rule=args.scale_rule), "nf4": nf4_dequantized}[args.format]
    rows = []
    for seed in args.seeds:
        model = ep.build("fp32", path, bench, seed)  # peft LoRA, its init seeded as the benchmark's
        keep = choose_protected(model, args.keep_fraction, args.format) if args.keep_fraction else []
        if args.keep_by == "random":
            keep = matched_random_protected(model, keep, seed)
        round_linears(model, rounded, keep)
        start = time.perf_counter()
        losses = ep.train(model, ep.batches(tokenizer, task.train, bench.steps, bench.batch, seed), bench.lr)
        train_s = round(time.perf_counter() - start, 1)
        accuracy = ep.evaluate(model, tokenizer, task)["accuracy"]
        row = {"user": args.user, "seed": seed, "format": args.format, "scale_rule": args.scale_rule,
               "kept": len(keep), "train_s": train_s, "accuracy": accuracy, "last_loss": losses[-1]}  # fmt: skip
        for method in ("pact", "fp32", "qlora"):
            run = saved.get(method, {}).get("seeds", {}).get(str(seed))
            if run:
                row[method] = {"accuracy": run["accuracy"], "last_loss": run["last_losses"][-1]}
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


if __name__ == "__main__":
    main()
