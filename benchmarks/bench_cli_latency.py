"""How long a person waits for an answer: the README's use commands timed as whole processes (`pact` start to its
exit after the last token), each run several times in turn, medians reported.

Commands (the adapter's GGUF cached beside it for the llama.cpp engine, the default model cached):
- `pact generate --adapter A "..."` and `pact chat --adapter A` with one line piped in (its first answer), on the
  pact engine (its quick path once the base is packed: no transformers or peft import, `commands/pact_quick.py`);
  `pact generate` on the full path beside it (transformers + peft, as before the quick path; `--backend torch`, an
  option the quick path leaves to it, sends it there); the same two with `--engine llama.cpp`;
- `python -c pass` (the interpreter alone), `python -c "import torch"` and the import of transformers' Llama code
  and peft beside them: the idle-noise arm, and what the pact engine pays before it loads anything.

    pact finetune --output run && python benchmarks/bench_cli_latency.py --adapter run/adapter
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import cpu_model, log, machine  # noqa: E402

PROMPT = "dentist appointment for Leo on Friday"
TARGETS = {"generate_pact": 3.0, "chat_pact": 3.0, "generate_llama": 1.5, "chat_llama": 1.5}  # seconds (issue 50)
DEFAULT_OUTPUT = Path(__file__).resolve().parent / "results" / "cli_latency" / "results.json"


def commands(pact: str, adapter: str, prompt: str = PROMPT) -> dict[str, tuple[list[str], str | None]]:
    """{arm: (argv, stdin)}."""
    llama = ["--engine", "llama.cpp"]
    return {
        "python_alone": ([sys.executable, "-c", "pass"], None),
        "import_torch": ([sys.executable, "-c", "import torch"], None),
        # what the pact engine must import before it can load anything: transformers' model code and peft
        "import_stack": ([sys.executable, "-c", "import transformers.models.llama.modeling_llama, peft"], None),
        "generate_pact": ([pact, "generate", "--adapter", adapter, prompt], None),
        "chat_pact": ([pact, "chat", "--adapter", adapter], prompt + "\n"),
        "generate_pact_full": ([pact, "generate", "--adapter", adapter, "--backend", "torch", prompt], None),
        "generate_llama": ([pact, "generate", "--adapter", adapter, *llama, prompt], None),
        "chat_llama": ([pact, "chat", "--adapter", adapter, *llama], prompt + "\n"),
    }


def timed(argv: list[str], stdin: str | None) -> tuple[float, str]:
    start = time.perf_counter()
    done = subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=600)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    answers = [line.removeprefix("> ").strip() for line in done.stdout.splitlines()]  # chat: "> " before each turn
    return seconds, next((line for line in reversed(answers) if line), "")


def markdown_table(results: dict) -> str:
    """The results as docs/benchmarks.md shows them (benchmarks/write_docs.py)."""
    lines = [
        f'`pact` start to exit after the answer, {results["rounds"]} rounds, prompt "{results["prompt"]}" (chat: '
        "the same line piped in, its first answer).",
        "",
        "| command | median (s) | min | max | target | answer |",
        "|---|---|---|---|---|---|",
    ]
    for arm, figures in results["summary"].items():
        target = results["targets"].get(arm, {})
        bound = f"{target['target']} s: {'met' if target['met'] else 'missed'}" if target else "-"
        answer = results["answers"].get(arm, "")
        lines.append(f"| `{arm}` | {figures['median_s']:.2f} | {figures['min_s']:.2f} | {figures['max_s']:.2f} | "
                     f"{bound} | {answer} |")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--adapter", required=True, help="a main-job adapter folder (e.g. a run's OUTPUT/adapter)")
    parser.add_argument("--rounds", type=int, default=5, help="times each command runs (in turn, A B C A B C ...)")
    parser.add_argument("--prompt", default=PROMPT, help="what each command answers (a chat adapter: a message)")
    parser.add_argument("--output", default=str(DEFAULT_OUTPUT))
    args = parser.parse_args()
    pact = shutil.which("pact") or str(Path(sys.executable).with_name("pact"))
    arms = commands(pact, args.adapter, args.prompt)
    log("warming up (the llama.cpp engine's GGUF is exported on its first use; the page cache filled)")
    for argv, stdin in arms.values():
        timed(argv, stdin)
    seconds: dict[str, list[float]] = {arm: [] for arm in arms}
    answers: dict[str, str] = {}
    for round_ in range(args.rounds):
        for arm, (argv, stdin) in arms.items():
            took, answers[arm] = timed(argv, stdin)
            seconds[arm].append(took)
            log(f"round {round_}: {arm:>14} {took:.2f} s")
    if answers["generate_pact"] != answers["generate_pact_full"]:
        raise SystemExit(f"the quick path answered {answers['generate_pact']!r}, the full path "
                         f"{answers['generate_pact_full']!r}")  # fmt: skip
    summary = {arm: {"median_s": statistics.median(v), "min_s": min(v), "max_s": max(v)} for arm, v in seconds.items()}
    medians = {arm: figures["median_s"] for arm, figures in summary.items()}
    targets = {arm: {"value": medians[arm], "target": f"<= {bound}", "met": medians[arm] <= bound}
               for arm, bound in TARGETS.items()}  # fmt: skip
    results = {"bench": "cli_latency", "date": date.today().isoformat(), "machine": machine(), "cpu": cpu_model(),
               "threads": os.cpu_count(), "rounds": args.rounds, "prompt": args.prompt,
               "adapter": args.adapter, "seconds": seconds,
               "answers": {arm: answers[arm] for arm in arms if not arm.startswith(("python", "import"))},
               "summary": summary, "targets": targets}  # fmt: skip
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps({k: results[k] for k in ("bench", "date", "cpu", "summary", "targets")} | {"output": str(out)}))


if __name__ == "__main__":
    main()
