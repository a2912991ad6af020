"""Decode speed: tokens per second generating on SmolLM2-135M-Instruct, batch 1, greedy.

Arms, interleaved round by round (each round runs every arm once, in a rotated order): PACT (`PactModelForCausalLM`,
torch backend, `dtype="auto"` as `pact generate` runs it (bf16 for inference), with an r=8 all-linear adapter, or
the one `--adapter` names, e.g. the main job's with its quarter of linears kept 16-bit: the user's case), the same
PACT model again (the noise arm), `pact_quick` (what `pact generate` runs once the base is packed: the same products
through `optimum_pact.decoder`, without transformers' generate loop), transformers bf16 and fp32
eager on the dequantized-GGUF weights without an adapter, and llama.cpp through llama-cpp-python on the Q4_1 GGUF the
default model comes from (`pip install optimum-pact[llama]`; otherwise the arm is reported missing) and on the same
adapter merged and exported by `pact export --format gguf` (NVFP4, f16 embeddings: `llama_cpp_nvfp4`), both with
the same threads. `sizes_mb` sets the files side by side: that GGUF, the Q4_1 GGUF and the bf16 folder of
`pact export --format merged-bf16`.

Decode speed excludes the prompt: (new_tokens - 1) / (time to generate new_tokens - time to generate 1).
Prints one JSON line with medians over rounds and the ratios measured side by side; `pact/best_transformers` sets
PACT against the faster of transformers' bf16 and fp32 on this CPU. `pact_ms_per_token` is where PACT's decoding
time goes, from timers around the parts in one more PACT run after the rounds: the native products (the decoder's
linears and, since PACT decodes its head natively too, the head's), the adapter layers (which include theirs), the
output head (the head module's forward) and the rest (transformers' own per-token work).

    python benchmarks/bench_decode.py --rounds 3
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import statistics
import tempfile
import time
from datetime import date
from pathlib import Path

import torch
from common import cpu_model, llama_cpp_arm, machine  # lscpu's model, AMX, vector width; llama.cpp's arm
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from optimum_pact.commands.default_model import default_gguf_path, ensure_default_model
from optimum_pact.commands.export import export_merged
from optimum_pact.commands.generate_options import light_parser
from optimum_pact.commands.gguf_export import export_gguf
from optimum_pact.commands.modeling import PactModelForCausalLM
from optimum_pact.commands.pact_quick import load_quick
from optimum_pact.nvfp4.kernels import NativeLinear
from peft_ext.layer import PactLoraLinear


def timed_generate(model, ids: torch.Tensor, new: int) -> float:
    start = time.perf_counter()
    with torch.no_grad():
        model.generate(input_ids=ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
    return time.perf_counter() - start


def decode_tps(model, ids: torch.Tensor, new: int) -> float:
    first = timed_generate(model, ids, 1)
    return (new - 1) / (timed_generate(model, ids, new) - first)


def quick_tps(quick, ids: list[int], new: int) -> float:
    """`decode_tps` for the quick path's decoder (greedy, no end of sequence)."""
    times = {}
    for n in (1, new):
        start = time.perf_counter()
        quick.decoder.greedy(ids, n, set())
        times[n] = time.perf_counter() - start
    return (new - 1) / (times[new] - times[1])


def breakdown(model, ids: torch.Tensor, new: int) -> dict[str, float]:
    """Milliseconds per decoded token in each part of PACT's decoding (timers around them; prompt excluded)."""
    spent: dict[str, float] = {}
    patched = [(NativeLinear, "run", "native_products"), (PactLoraLinear, "forward", "adapter_layers")]
    # the head: its forward is set on the instance by PACT's loading (optimum_pact/head.py), else nn.Linear's
    head = model.model.get_output_embeddings()
    owner = head if "forward" in vars(head) else torch.nn.Linear
    patched.append((owner, "forward", "output_head"))
    originals = [(cls, name, getattr(cls, name)) for cls, name, _ in patched]

    def timed(real, part):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return real(*args, **kwargs)
            finally:
                spent[part] = spent.get(part, 0.0) + time.perf_counter() - start

        return wrapper

    try:
        for cls, name, part in patched:
            setattr(cls, name, timed(getattr(cls, name), part))
        first = timed_generate(model, ids, 1)
        prompt_only = dict(spent)
        total = timed_generate(model, ids, new) - first
    finally:
        for cls, name, real in originals:
            setattr(cls, name, real)
    per_token = {part: (spent[part] - 2 * prompt_only.get(part, 0.0)) / (new - 1) * 1e3 for part in spent}
    per_token["total"] = total / (new - 1) * 1e3
    per_token["rest"] = per_token["total"] - per_token["adapter_layers"] - per_token.get("output_head", 0.0)
    return {part: round(ms, 2) for part, ms in per_token.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--adapter", help="an adapter folder on the default model (default: a new r=8 all-linear one)")
    parser.add_argument("--output", help="also write the JSON line here, for docs/benchmarks.md (write_docs.py)")
    args = parser.parse_args()
    threads = torch.get_num_threads()
    base = ensure_default_model()
    ids = torch.randint(100, 40000, (1, args.prompt_tokens), generator=torch.Generator().manual_seed(0))
    exported = Path(tempfile.mkdtemp(prefix="bench-decode-"))
    adapter = Path(args.adapter) if args.adapter else exported / "adapter"
    if not args.adapter:
        lora = get_peft_model(
            AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16),
            LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", init_lora_weights=False),
        )
        lora.save_pretrained(adapter)
        del lora
    pact = PactModelForCausalLM.from_pretrained(str(base), adapter=str(adapter))  # dtype "auto", as pact generate
    quick = load_quick(light_parser("chat").parse_args(["--model", str(base), "--adapter", str(adapter)]))
    sizes = {}
    if importlib.util.find_spec("llama_cpp") is not None:
        # the GGUF --engine llama.cpp decodes (merged without scoring), and the bf16 folder for its size
        nvfp4_gguf = export_gguf(adapter, exported / "me.gguf", score=False)
        export_merged(adapter, exported / "bf16")
        sizes = {
            "gguf_nvfp4": nvfp4_gguf.stat().st_size,
            "gguf_q4_1": default_gguf_path().stat().st_size,
            "bf16_folder": sum(f.stat().st_size for f in (exported / "bf16").iterdir()),
        }
    bf16 = AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16).eval()
    fp32 = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    arms = {
        "pact": lambda: decode_tps(pact, ids, args.new_tokens),
        "pact_dup": lambda: decode_tps(pact, ids, args.new_tokens),
        "pact_quick": lambda: quick_tps(quick, ids[0].tolist(), args.new_tokens),
        "bf16": lambda: decode_tps(bf16, ids, args.new_tokens),
        "fp32": lambda: decode_tps(fp32, ids, args.new_tokens),
    }
    llama = llama_cpp_arm(ids[0].tolist(), args.new_tokens, threads)
    if llama is not None:
        arms["llama_cpp"] = llama
        arms["llama_cpp_nvfp4"] = llama_cpp_arm(ids[0].tolist(), args.new_tokens, threads, nvfp4_gguf)
    tps = {name: [] for name in arms}
    for r in range(args.rounds + 1):  # round 0 warms up
        names = list(arms)
        for name in names[r % len(names) :] + names[: r % len(names)]:
            value = arms[name]()
            if r:
                tps[name].append(value)
    med = {name: statistics.median(values) for name, values in tps.items()}
    parts = breakdown(pact, ids, args.new_tokens)
    ratio = {"pact/bf16": med["pact"] / med["bf16"], "pact/fp32": med["pact"] / med["fp32"]}
    ratio["pact/best_transformers"] = med["pact"] / max(med["bf16"], med["fp32"])
    ratio["pact_quick/best_transformers"] = med["pact_quick"] / max(med["bf16"], med["fp32"])
    ratio["dup/pact"] = med["pact_dup"] / med["pact"]
    if "llama_cpp" in med:
        ratio["pact/llama_cpp"] = med["pact"] / med["llama_cpp"]
        ratio["pact_quick/llama_cpp"] = med["pact_quick"] / med["llama_cpp"]
        ratio["nvfp4_gguf/q4_1_gguf"] = med["llama_cpp_nvfp4"] / med["llama_cpp"]
        ratio["nvfp4_gguf/pact"] = med["llama_cpp_nvfp4"] / med["pact"]
    results = {
        "bench": "decode",
        "date": date.today().isoformat(),
        "cpu": cpu_model(),
        "machine": machine(),
        "threads": threads,
        "pact_dtype": str(pact.model.dtype).removeprefix("torch."),
        "adapter": str(args.adapter or "r=8 all-linear, random B"),
        "sixteen_bit_linears": len(pact.model.peft_config["default"].sixteen_bit_modules()),
        "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens,
        "rounds": args.rounds,
        "tokens_per_s_median": {k: round(v, 2) for k, v in med.items()},
        "tokens_per_s_all": {k: [round(v, 2) for v in vs] for k, vs in tps.items()},
        "ratios": {k: round(v, 3) for k, v in ratio.items()},
        "pact_ms_per_token": parts,
        "sizes_mb": {k: round(v / 1e6, 1) for k, v in sizes.items()},
        "llama_cpp": "measured" if "llama_cpp" in med else "not installed (pip install optimum-pact[llama])",
        "targets": {
            "pact_ge_bf16": ratio["pact/bf16"] >= 1.0,
            "pact_quick_ge_1.5_best_transformers": ratio["pact_quick/best_transformers"] >= 1.5,
            "pact_quick_ge_half_llama_cpp": (ratio["pact_quick/llama_cpp"] >= 0.5 if "llama_cpp" in med else None),
            "pact_ge_half_llama_cpp": ratio["pact/llama_cpp"] >= 0.5 if "llama_cpp" in med else None,
            "nvfp4_gguf_ge_0.9_q4_1": ratio["nvfp4_gguf/q4_1_gguf"] >= 0.9 if "llama_cpp" in med else None,
            "nvfp4_gguf_ge_3_pact": ratio["nvfp4_gguf/pact"] >= 3.0 if "llama_cpp" in med else None,
        },
    }
    print(json.dumps(results))
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(results, indent=1) + "\n")
    shutil.rmtree(exported, ignore_errors=True)


if __name__ == "__main__":
    main()
