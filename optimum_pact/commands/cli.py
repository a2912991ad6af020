"""`pact` console script. `pact finetune` with no arguments runs the main job on the embedded model and data."""

from __future__ import annotations

import argparse
import logging
import sys

from .backends import BACKEND_CHOICES
from .memory import MEMORY_SAVER_PRESETS


def _finetune_parser(sub) -> None:
    p = sub.add_parser("finetune", help="LoRA fine-tune with an NVFP4 data-flow base (default: built-in model+data)")
    p.add_argument("--model", help="model folder or Hub id (default: SmolLM2-135M-Instruct, fetched once)")
    p.add_argument("--data", help="JSONL file of {'text': ..., 'label': ...} items (default: built-in notes)")
    p.add_argument("--output", default="pact-output", help="where the adapter and summary.json go")
    p.add_argument(
        "--backend",
        default="torch",
        choices=BACKEND_CHOICES,
        help="backend for the frozen-weight products (auto: qnn where a real QNN HTP starts, else torch)",
    )
    p.add_argument("--soc-model", help="qnn: the Snapdragon SoC id the NPU graphs are compiled for (default 60)")
    p.add_argument(
        "--precision-budget-mib",
        type=float,
        help="probe gradient sensitivity on a calibration batch and keep the most sensitive linears fp16 "
        "within this many MiB above all-NVFP4 (the plan is saved in pact_config.json)",
    )
    p.add_argument("--r", type=int, default=8, help="LoRA rank")
    p.add_argument("--lora-alpha", type=int, default=16, help="LoRA alpha")
    p.add_argument("--learning-rate", type=float, default=2e-3)
    p.add_argument("--epochs", type=float, default=2.0)
    p.add_argument("--max-steps", type=int, default=-1, help="stop after this many steps (overrides --epochs)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"), help="compute dtype")
    p.add_argument("--seed", type=int, default=0)
    q = p.add_argument_group("AQLoRA", "keep the layers 4 bits hurt most 16-bit (faster: no dequantization)")
    q.add_argument("--protect-fraction", type=float, default=0.0, help="fraction of linears kept 16-bit, e.g. 0.2")
    q.add_argument("--rank-by", default="nvfp4", choices=("nvfp4", "nf4"), help="format whose error ranks layers")
    q.add_argument(
        "--adapt",
        default="quality",
        choices=("quality", "speed"),
        help="quality: adapt every linear; speed: only the top blocks, so backward stops early",
    )
    q.add_argument("--adapt-top-blocks", type=int, help="--adapt speed: how many top blocks (default: top half)")
    m = p.add_argument_group("memory savers", "train in a fraction of the memory (optimum_pact.memory)")
    m.add_argument(
        "--memory-saver",
        default="none",
        choices=tuple(MEMORY_SAVER_PRESETS),
        help="exact: block checkpointing with disk offload, mapped weights, logits only at labelled positions (same "
        "gradients); full: exact + softmax over the target's --subset-k nearest tokens and the batch's targets "
        "(approximate)",
    )
    m.add_argument("--offload-dir", help="folder for offloaded activations (default: OUTPUT/trainer/pact-offload)")
    m.add_argument("--subset-k", type=int, help="--memory-saver full: tokens per softmax (default 1000)")
    b = p.add_argument_group(
        "background job",
        "run at night, on the charger, killable at any moment: re-running the same command continues where it "
        "stopped; one run per --output (a lock file)",
    )
    b.add_argument(
        "--background",
        action="store_true",
        help="thermal pacing + atomic checkpoints + resume; SIGTERM/SIGINT saves a checkpoint and exits",
    )
    b.add_argument("--save-steps", type=int, help="checkpoint every N steps (default 20)")
    b.add_argument("--save-minutes", type=float, help="also checkpoint every M minutes (default 10)")
    b.add_argument("--keep-checkpoints", type=int, help="checkpoints kept (default 2)")
    b.add_argument(
        "--thermal-limit",
        type=float,
        help="pause at this temperature in C (default: 40 on a phone's skin sensor, 85 on CPU sensors)",
    )
    b.add_argument("--duty-cycle", type=float, help="train at most this fraction of the time (0-1]")
    b.add_argument("--only-while-charging", action="store_true", help="pause while not on external power")
    b.add_argument("--min-battery", type=int, help="pause while the battery is below this percentage")
    b.add_argument("--sysfs-root", default="/sys", help="where thermal and power sensors are read (default /sys)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pact", description="PACT: on-device LoRA fine-tuning.")
    sub = parser.add_subparsers(dest="command", required=True)
    _finetune_parser(sub)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    if args.command == "finetune":
        from trainer_callbacks import OutputDirLockedError, TrainingInterrupted

        from .backends import BackendUnavailableError
        from .finetune import finetune

        kwargs = {k: v for k, v in vars(args).items() if k != "command"}
        try:
            summary = finetune(**kwargs)
        except (FileNotFoundError, ValueError, TypeError, BackendUnavailableError, OutputDirLockedError) as err:
            print(f"pact finetune: error: {err}", file=sys.stderr)
            return 2
        except TrainingInterrupted as stop:
            print(f"pact finetune: {stop}", file=sys.stderr)
            return 128 + stop.signum
        print(summary.render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
