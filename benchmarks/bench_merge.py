"""How much of an adapter's gain each NVFP4 merge keeps: `pact export --format nvfp4-merged` four ways.

Arms: the usual merge (`requantize_from="nvfp4"`: dequantize, add the adapter's change, quantize again), the default
(`"original"`: the full-precision weights with the change folded in, rounded once), and each with a quarter of the
linears kept bf16. Each exported folder is reloaded and scored on the data's held-out items; prints one JSON line
with the base / adapter / merged scores and the share of the gain and of the weight change each merge keeps.

    pact finetune --output run && python benchmarks/bench_merge.py --adapter run/adapter
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from optimum_pact.commands.nvfp4_merge import export_nvfp4_merged
from optimum_pact.precision import resolve_dtype

sys.path.insert(0, str(Path(__file__).parent))
from common import cpu_model  # noqa: E402  (lscpu's model, AMX, vector width)

ARMS = {
    "nvfp4": {"requantize_from": "nvfp4"},
    "nvfp4_keep_16bit_0.25": {"requantize_from": "nvfp4", "keep_16bit": 0.25},
    "original": {"requantize_from": "original"},
    "original_keep_16bit_0.25": {"requantize_from": "original", "keep_16bit": 0.25},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--adapter", required=True, help="an adapter folder (e.g. a run's OUTPUT/adapter)")
    parser.add_argument("--model", default=None, help="its base (default: the main job's)")
    parser.add_argument("--data", default=None, help="data scoring it (default: the main job's)")
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, options in ARMS.items():
            start = time.perf_counter()
            report = export_nvfp4_merged(args.adapter, Path(tmp) / name, args.model, args.data, **options)
            results[name] = {**asdict(report), "seconds": round(time.perf_counter() - start, 1)}
            results[name]["kept_16bit"] = len(report.kept_16bit)
    print(
        json.dumps(
            {
                "bench": "nvfp4_merge",
                "cpu": cpu_model(),
                "dtype": str(resolve_dtype("auto")).removeprefix("torch."),
                "adapter": args.adapter,
                "arms": results,
            }
        )
    )


if __name__ == "__main__":
    main()
