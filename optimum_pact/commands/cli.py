"""`pact` console script. `pact finetune` with no arguments runs the main job on the embedded model and data."""

from __future__ import annotations

import logging
import sys
from importlib.metadata import version

from .noise import quiet_third_party

USAGE = (
    "usage: pact finetune [options]        fine-tune an adapter (default: the built-in model and data)\n"
    '       pact generate [options] "prompt"  answer with a trained adapter\n'
    "       pact chat [options]              chat with a trained adapter (/reset, /quit)\n"
    "       pact export --adapter DIR --output DIR   the adapter merged into a plain transformers folder\n"
    "       pact export --format gguf-lora --adapter DIR --output FILE.gguf   the adapter for llama.cpp\n"
    "       pact export --format nvfp4-merged --adapter DIR --output DIR   merged into one NVFP4 model, scored\n"
    "(pact COMMAND --help lists every option; pact --version)"
)
COMMANDS = ("finetune", "generate", "chat", "export")


def _error(err: Exception, spelled: dict[str, str]) -> str:
    """The message, led by the flag (or run-file key) the user wrote when it is about one option they gave."""
    typed = spelled.get(getattr(err, "option", None))
    return str(err) if typed is None else f"{typed}: {err}"


def finetune_main(argv: list[str]) -> int:
    from trainer_callbacks import TrainingInterrupted
    from trainer_callbacks.lock import OutputDirLockedError

    from ..backends import BackendUnavailableError
    from ..errors import NoSpaceError
    from .arguments import parse_finetune_args
    from .finetune import finetune

    spelled: dict[str, str] = {}
    said = (FileNotFoundError, ValueError, TypeError, BackendUnavailableError, OutputDirLockedError, NoSpaceError)
    try:
        run = parse_finetune_args(argv, spelled)
        summary = finetune(run)
    except said as err:  # errors whose message says what to do: one line, no traceback
        print(f"pact finetune: error: {_error(err, spelled)}", file=sys.stderr)
        return 2
    except TrainingInterrupted as stop:
        print(f"pact finetune: {stop}", file=sys.stderr)
        return 128 + stop.signum
    print(summary.render())
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    quiet_third_party()  # before anything imports torchao, bitsandbytes or peft
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if not argv or argv[0] in ("-h", "--help"):
        print("pact: on-device LoRA fine-tuning.\n" + USAGE)
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        print(f"pact (optimum-pact) {version('optimum-pact')}")
        return 0
    if argv[0] not in COMMANDS:
        print(f"pact: error: unknown command {argv[0]!r}.\n{USAGE}", file=sys.stderr)
        return 2
    if argv[0] == "finetune":
        return finetune_main(argv[1:])
    if argv[0] == "export":
        return export_main(argv[1:])
    return generation_main(argv[0], argv[1:])


def generation_main(command: str, argv: list[str]) -> int:
    from .llama_quick import quick_run

    done = quick_run(command, argv)  # --engine llama.cpp with the GGUF cached: llama.cpp alone, no torch import
    if done is None:
        from .pact_quick import quick_run as pact_quick_run

        done = pact_quick_run(command, argv)  # the pact engine on a packed base: no transformers or peft import
    if done is not None:
        return done
    from transformers.utils.logging import disable_progress_bar

    from ..backends import BackendUnavailableError
    from .generation import parse, run_chat, run_generate

    disable_progress_bar()  # the answer is the output: no weight-loading bar before it
    try:
        args, prompt = parse(argv, command)
        if command == "generate":
            run_generate(args, prompt)  # streamed, ending with a newline
        else:
            run_chat(args)
    except (FileNotFoundError, ValueError, TypeError, BackendUnavailableError) as err:
        print(f"pact {command}: error: {err}", file=sys.stderr)
        return 2
    return 0


def export_main(argv: list[str]) -> int:
    from transformers import HfArgumentParser

    from ..backends import BackendUnavailableError
    from ..errors import NoSpaceError
    from .export import ExportArguments, export

    (args,) = HfArgumentParser(ExportArguments, prog="pact export").parse_args_into_dataclasses(argv)
    try:
        path = export(args)
    except (FileNotFoundError, FileExistsError, ValueError, TypeError, BackendUnavailableError, NoSpaceError) as err:
        print(f"pact export: error: {err}", file=sys.stderr)
        return 2
    print(f"exported {args.adapter} as {args.format}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
