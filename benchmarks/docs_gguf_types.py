"""docs/benchmarks.md's table for bench_gguf_types.py's results (apart from the benchmark, which imports torch)."""

from __future__ import annotations

from pathlib import Path

OLD_AUTO = "16-bit linears Q5_1 (auto's earlier type for them; this run records no types)"


def gguf_types_table(results: dict) -> str:
    """The table docs/benchmarks.md shows for a results file of bench_gguf_types.py."""
    choices = list(results["runs"][0]["files"])
    lines = ["Each file's size, llama.cpp's held-out accuracy on the main job's notes and, where measured, the mean "
             "KL of llama.cpp's next-token distributions from the merged model's (over the held-out notes), "
             "beside the adapter's use path (`pact generate`'s model) and the GGUF the base came from:", "",
             "| base | " + " | ".join(f"`{c}`" for c in choices) + " | use path | source GGUF |",
             "|---" * (3 + len(choices)) + "|"]  # fmt: skip
    for run in results["runs"]:
        cells = " | ".join(f"{f['mb']:.1f} MB, {100 * f['accuracy']:.1f}%"
                           + (f", KL {f['kl_from_merged']:.4f}" if "kl_from_merged" in f else "")
                           for f in run["files"].values())  # fmt: skip
        source = f"{run['source_gguf_mb']:.1f} MB" if run.get("source_gguf_mb") else "-"
        lines.append(f"| {Path(run['base']).name} | {cells} | {100 * run['use_path_accuracy']:.1f}% | {source} |")
    lines.append("")
    for run in results["runs"]:
        types = run["files"].get("auto", {}).get("types")
        words = ", ".join(f"{role} {kind}" for role, kind in types.items()) if types else OLD_AUTO
        lines.append(f"- {Path(run['base']).name} ({run['date']}, {run['cpu']}): `auto` wrote {words}")
    return "\n".join(lines)
