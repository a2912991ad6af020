"""How much of an adapter's gain each NVFP4 merge keeps: `pact export --format nvfp4-merged` several ways.

Arms: GPTQ rounding of the weights the adapter was trained against plus its change (`rounding="gptq"`,
`requantize_from="nvfp4"`: the default), GPTQ of the full-precision weights plus the change, and the nearest
rounding of either (`"nearest"`: the usual merge from "nvfp4", the default before issue 49 from "original"), the
nearest ones also with a quarter of the linears kept bf16. Each exported folder is reloaded and scored on the data's
held-out items; prints one JSON line with the base / adapter / merged scores and the share of the gain and of the
weight change each merge keeps.

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

from optimum_pact.commands.modeling import read_adapter_config
from optimum_pact.commands.nvfp4_merge import export_nvfp4_merged

sys.path.insert(0, str(Path(__file__).parent))
from common import cpu_model  # noqa: E402  (lscpu's model, AMX, vector width)

ARMS = {
    "gptq_nvfp4": {"rounding": "gptq", "requantize_from": "nvfp4"},
    "gptq_original": {"rounding": "gptq", "requantize_from": "original"},
    "nearest_nvfp4": {"rounding": "nearest", "requantize_from": "nvfp4"},
    "nearest_nvfp4_keep_16bit_0.25": {"rounding": "nearest", "requantize_from": "nvfp4", "keep_16bit": 0.25},
    "nearest_original": {"rounding": "nearest", "requantize_from": "original"},
    "nearest_original_keep_16bit_0.25": {"rounding": "nearest", "requantize_from": "original", "keep_16bit": 0.25},
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
                "dtype": read_adapter_config(args.adapter).base_dtype or "bfloat16 (not recorded: generation's auto)",
                "adapter": args.adapter,
                "arms": results,
            }
        )
    )


if __name__ == "__main__":
    main()
