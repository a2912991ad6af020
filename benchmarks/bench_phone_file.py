"""The phone file's decode speed (issue 51, item 4): a `pact export --format gguf` file of a named model beside the
GGUF the model came from, both decoded by llama.cpp in one process, round by round in turn.

    pact export --format gguf --adapter qwen-run/adapter --output me.gguf
    python benchmarks/bench_phone_file.py --gguf me.gguf --model qwen2.5-coder-1.5b --rounds 3

Decode speed as bench_decode measures it: (new_tokens - 1) / (time for new_tokens - time for 1), greedy, batch 1,
every core. The two files' sizes beside it; their held-out accuracy is bench_gguf_types.py's. Prints one JSON line;
--output writes it too.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from datetime import date
from pathlib import Path

from common import cpu_model, llama_cpp_arm, log, machine
from transformers import AutoTokenizer

from optimum_pact.commands.data import load_personal_dataset
from optimum_pact.commands.named_models import ensure_named_model, gguf_path, named_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", required=True, help="an exported file (pact export --format gguf) of --model")
    parser.add_argument("--model", default="qwen2.5-coder-1.5b", help="the named model it was trained on")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--output", help="also write the JSON here")
    args = parser.parse_args()
    named = named_model(args.model)
    if named is None:
        parser.error(f"--model {args.model!r} is not a named model")
    files = {"pact_gguf": Path(args.gguf), "source": gguf_path(named)}
    _, heldout = load_personal_dataset()
    tokenizer = AutoTokenizer.from_pretrained(ensure_named_model(named))
    prompt = tokenizer(" ".join(item["text"] for item in heldout))["input_ids"][: args.prompt_tokens]
    threads = os.cpu_count() or 1
    arms = {name: llama_cpp_arm(prompt, args.new_tokens, threads, path) for name, path in files.items()}
    speeds: dict[str, list[float]] = {name: [] for name in arms}
    for i in range(args.rounds):
        for name in list(arms)[i % 2 :] + list(arms)[: i % 2]:  # each file first in every other round
            speeds[name].append(arms[name]())
            log(f"round {i}: {name} {speeds[name][-1]:.1f} tokens/s")
    sizes = {name: path.stat().st_size / 1e6 for name, path in files.items()}
    median = {name: statistics.median(values) for name, values in speeds.items()}
    out = {
        "bench": "phone_file", "model": named.name, "gguf": str(args.gguf), "source": named.gguf,
        "date": date.today().isoformat(), "cpu": cpu_model(), "machine": machine(), "threads": threads,
        "rounds": args.rounds, "prompt_tokens": len(prompt), "new_tokens": args.new_tokens, "size_mb": sizes,
        "size_ratio": sizes["pact_gguf"] / sizes["source"], "decode_tokens_per_s": median,
        "decode_ratio": median["pact_gguf"] / median["source"], "decode_rounds": speeds,
    }  # fmt: skip
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
