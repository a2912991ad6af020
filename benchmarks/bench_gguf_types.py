"""What `pact export --format gguf --embeddings ...` costs and keeps: one adapter merged once (the export's own merge,
its defaults), written with each --embeddings choice, each file's size, its held-out accuracy in llama.cpp beside
the adapter's use path (PactModelForCausalLM, as `pact generate` runs it) and how far llama.cpp's next-token
distributions are from the merged model's own (mean KL over every position of the held-out notes: a measure that does
not move in steps of one note), and, for a named model, the size of the GGUF it came from.

    python benchmarks/bench_gguf_types.py --adapter run/adapter --output benchmarks/results/gguf_types/results.json
    python benchmarks/bench_gguf_types.py --adapter qwen-run/adapter --model qwen2.5-coder-1.5b --output ...

The labelled main job's held-out notes; untimed. Prints one JSON line; --output adds it to that file's runs
(replacing a run of the same base).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from datetime import date
from pathlib import Path

import torch
from common import cpu_model, log, machine
from transformers import AutoModelForCausalLM

from optimum_pact.commands.data import load_personal_dataset
from optimum_pact.commands.evaluation import accuracy, classify
from optimum_pact.commands.finetune import tokenize_examples
from optimum_pact.commands.gguf_export import EMBEDDINGS, write_gguf
from optimum_pact.commands.llama_score import llama_cpp_accuracy
from optimum_pact.commands.modeling import PactModelForCausalLM
from optimum_pact.commands.named_models import named_model
from optimum_pact.commands.nvfp4_merge import save_merged


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--adapter", required=True, help="a main-job adapter (OUTPUT/adapter of pact finetune)")
    parser.add_argument("--model", help="its base (default: the one the adapter records)")
    parser.add_argument("--choices", default="auto,q8_0,f16", help=f"of {', '.join(EMBEDDINGS)}")
    parser.add_argument("--output", help="also write the JSON here")
    args = parser.parse_args()
    train, heldout = load_personal_dataset()
    labels = sorted({item["label"] for item in train + heldout})
    texts, golds = [i["text"] for i in heldout], [i["label"] for i in heldout]
    model = PactModelForCausalLM.from_pretrained(args.model, adapter=args.adapter)
    use_path = accuracy(classify(model.model, model.tokenizer, texts, labels), golds)
    tokenizer, base = model.tokenizer, model.base_path
    del model
    files = {}
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        folder = save_merged(args.adapter, Path(tmp) / "merged", args.model)
        merge_s = time.perf_counter() - start
        rows = [row["input_ids"] for row in tokenize_examples(tokenizer, heldout)]
        merged = _log_probs(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32), rows)
        for choice in args.choices.split(","):
            path = write_gguf(folder, Path(tmp) / f"{choice}.gguf", embeddings=choice)
            files[choice] = {"mb": path.stat().st_size / 1e6,
                             "accuracy": llama_cpp_accuracy(path, tokenizer, heldout, labels),
                             "kl_from_merged": _kl_from(merged, path, rows),
                             "types": {role: kind.name for role, kind in EMBEDDINGS[choice].items()}}  # fmt: skip
            log(choice, files[choice])
    named = named_model(args.model or "smollm2-135m")  # the default model is the named SmolLM2
    source_mb = named.size / 1e6 if named is not None else None
    out = {
        "bench": "gguf_types", "adapter": str(args.adapter), "base": str(base), "date": date.today().isoformat(),
        "cpu": cpu_model(), "machine": machine(), "merge_s": merge_s, "use_path_accuracy": use_path,
        "files": files, "source_gguf_mb": source_mb,
        "size_ratio_to_source": {k: v["mb"] / source_mb for k, v in files.items()} if source_mb else None,
        "gguf_minus_use_path_pts": {k: 100 * (v["accuracy"] - use_path) for k, v in files.items()},
    }  # fmt: skip
    if args.output:
        path = Path(args.output)
        results = json.loads(path.read_text()) if path.is_file() else {"bench": "gguf_types", "runs": []}
        results["runs"] = [run for run in results["runs"] if run["base"] != out["base"]] + [out]
        results["pieces"] = [{"machine": run["machine"], "date": run["date"]} for run in results["runs"]]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(results, indent=1) + "\n")
    print(json.dumps(out))


@torch.no_grad()
def _log_probs(model, rows: list[list[int]]) -> list[torch.Tensor]:
    return [torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].double(), -1) for ids in rows]


def _kl_from(merged: list[torch.Tensor], path: Path, rows: list[list[int]]) -> float:
    """Mean over the rows of the per-position KL(merged || llama.cpp on the file at `path`)."""
    from llama_cpp import Llama

    llm = Llama(model_path=str(path), logits_all=True, n_ctx=512, n_threads=torch.get_num_threads(), verbose=False)
    try:
        kls = []
        for ids, mine in zip(rows, merged):
            llm.reset()
            llm.eval(ids)
            theirs = torch.log_softmax(torch.from_numpy(llm.scores[: len(ids)]).double(), -1)
            kls.append((mine.exp() * (mine - theirs)).sum(-1).mean().item())
    finally:
        llm.close()
    return sum(kls) / len(kls)


if __name__ == "__main__":
    main()
