"""Peak memory of one LoRA forward + backward at batch 1, down the cumulative stack of PACT's memory savers.

Arms (the first five each add to the one before; one fresh process per arm):
    baseline    peft LoRA, fp32 weights and compute, sdpa attention, full-vocabulary loss
    nvfp4       PACT: the targeted linears frozen as NVFP4 (`get_peft_model(model, PactConfig(...))`)
    checkpoint  + per-block checkpointing, block inputs offloaded to disk, selective caching, chunked MLP,
                  frozen weights memory-mapped from disk (`map_frozen_weights`) and streamed (`WeightStream`:
                  each weight's pages handed back to the kernel once its product is done)
    subset      + softmax over the target's 1000 nearest tokens (logits [tokens, 1000], never [tokens, vocab])
    mask        + logits masking: the output head runs only at labelled positions (the 'full' preset)
    exact       the 'exact' preset: checkpoint + mask, full-vocabulary softmax (no approximation)
    mask_unstreamed  mask with the weights mapped but not streamed: what streaming saves, and its step-time cost
LoRA r=16 (alpha 32) on all linears, fp32 activations, labels on the last 30% of the tokens (the prompt is -100).

The headline (`headline`, `resident_ratio_vs_baseline`) is resident memory as the kernel counts it: VmHWM above
an idle process, mapped pages included, for 'full' (mask) and 'exact' against the baseline. A baseline too large
to run (`--fake-arms baseline`) is counted by its fake-tensor live peak, which is below what its VmHWM would be:
the ratio is then conservative, and the JSON says so (`baseline_resident_from`).

What is measured, per arm:
(a) live-tensor peak: `optimum_pact.memory.LiveTensorTracker`, a TorchDispatchMode that registers the storage of
    every tensor an operator returns (forward, recomputation, backward) and a weak reference that subtracts its
    bytes when the storage is freed; the peak of that running sum. Model weights held in process memory count as
    live: every parameter and buffer (fp32 embedding and output head, packed NVFP4 weights and scales, norms, LoRA
    matrices) plus the batch, registered before the step. From the checkpoint arm on, the frozen weights are
    memory-mapped from a file instead (page cache the kernel reads on demand and may drop, as a phone's model file
    would be): they are reported as `mapped_gib`, not counted in the live peak; LoRA matrices, their gradients,
    norms and every activation are. Not seen: scratch memory a kernel allocates and frees inside one operator,
    allocator slack, the interpreter and libraries; those are in (b), as are the mapped pages a step touches.
(b) VmHWM minus idle: the process's resident high-water mark over the step (reset with /proc/self/clear_refs after
    the model is built and freed memory trimmed, so model construction does not count) minus the resident size of
    an idle process with the same imports. It includes the weights and everything (a) does not see, such as
    the heap the model build leaves behind (~0.2 GiB for SmolLM2: fragmentation, the same in every arm).
    `step_growth_gib` is VmHWM minus the resident size just before the step: what the step itself added. Every
    process (idle included) runs with glibc's MALLOC_MMAP_THRESHOLD_=65536 (`--malloc-mmap-threshold`), so a freed
    tensor's memory goes back to the system: with glibc's default, the threshold rises to 32 MiB after the first
    large free and freed tensors stay in the heap (SmolLM2 subset arm at 512 tokens: step growth 0.55 GiB with the
    default, 0.20 GiB with 64 KiB, for a live peak of 0.11 GiB plus 0.16 GiB of mapped weights). This is the
    headline.
(c) the live peak plus the mapped bytes the step touched (`live_plus_mapped_touched_gib`: the tracked step runs
    unstreamed, then the weights file's resident pages are read from /proc/self/pagemap), and the mapped bytes
    alone (`mapped_touched_gib`; `mapped_resident_peak_gib`: the most of them seen resident while streaming).
A step runs twice per process: first untracked, timed, for (b) and the step time (streamed, in streamed arms); then
tracked, for (a) and (c).
NVFP4 arms use PactConfig(backend_options={"tile_size": 256}) (dequantized tiles of 256 rows / columns, never the
whole weight); the savers use MemorySavers' defaults (no attention cache, `--cache-mib` sets one; MLP recomputed in
chunks of 512 tokens). Step times on a shared 2-core machine are noise: compare them only from a quiet run.

Quality guard (`--quality`): SmolLM2 fine-tuned on the built-in data with the full stack and with the baseline
(same batches), held-out accuracy before/after and the loss curves (CSV; PNG when matplotlib is installed), for
`--quality-seeds` seeds; the gap is judged on its mean (60 held-out items: one item is 1.7 points).

Baseline too large for the machine: `--fake-arms baseline` runs the same build and step functions on fake tensors
(`optimum_pact.memory.fake_peak`: the model is built on the meta device, its weights become fake CPU tensors, the
step runs under FakeTensorMode with the same tracker), which gives (a) without allocating; `--validate-fake`
measures the baseline both ways at the given size (the numbers must agree).

Architectures: Llama-3.2-1B, Qwen2.5-0.5B and Qwen2.5-3B from their published configs with random weights (right
for memory, not for quality; the 3B is quantized while it is built, `build_quantized`), SmolLM2-135M-Instruct and
Qwen2.5-Coder-1.5B-Instruct with their real weights (the latter's fetched and converted as `pact finetune --model
qwen2.5-coder-1.5b` does: from a 4-5-bit GGUF, dequantized). Prints one JSON line per configuration with every
arm's ratio to the baseline.

    python benchmarks/bench_memory.py --quick                       # tiny model, seconds; validates the script
    python benchmarks/bench_memory.py --arch qwen2.5-0.5b --seq 3072 --arms baseline,mask,exact,mask_unstreamed
    python benchmarks/bench_memory.py --arch qwen2.5-3b --seq 4096 --fake-arms baseline --arms baseline,mask,exact
    python benchmarks/bench_memory.py --arch qwen2.5-0.5b --seq 3072
    python benchmarks/bench_memory.py --arch qwen2.5-coder-1.5b --seq 4096 --fake-arms baseline \
        --arms baseline,exact --resident-only
    python benchmarks/bench_memory.py --arch qwen2.5-0.5b --seq 4096 --fake-arms baseline \
        --arms baseline,checkpoint,subset,mask
    python benchmarks/bench_memory.py                               # every configuration of issue 4 (needs ~20 GiB)
    python benchmarks/bench_memory.py --quality                     # quality guard: loss curves + held-out accuracy
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import cpu_model, reset_peak_rss, status_bytes, trim_memory  # the CPU (every timing says it), /proc
from memory_quality import QUALITY_ARMS, quality_guard

ARMS = ("baseline", "nvfp4", "checkpoint", "subset", "mask", "exact", "mask_unstreamed")
SAVERS = {  # MemorySavers options per arm (None: no savers); mapped weights are streamed unless said otherwise
    "baseline": None,
    "nvfp4": None,
    "checkpoint": {"map_weights": True, "subset_k": None, "mask_logits": False},
    "subset": {"map_weights": True, "subset_k": 1000, "mask_logits": False},
    "mask": {"map_weights": True, "subset_k": 1000, "mask_logits": True},  # the full stack ('full' preset)
    "exact": {"map_weights": True, "subset_k": None, "mask_logits": True},  # the 'exact' preset: no approximation
    "mask_unstreamed": {"map_weights": True, "subset_k": 1000, "mask_logits": True, "stream_weights": False},
}
HEADLINE = ("mask", "exact")  # the full stack and the exact one, each against the baseline
# Published configs (config.json of meta-llama/Llama-3.2-1B and Qwen/Qwen2.5-0.5B); weights are random.
ARCHS = {
    "llama-3.2-1b": dict(
        model_type="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, vocab_size=128256, max_position_embeddings=131072, rms_norm_eps=1e-5,
        rope_theta=500000.0, tie_word_embeddings=True, hidden_act="silu",
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192},
    ),
    "qwen2.5-0.5b": dict(
        model_type="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768, rms_norm_eps=1e-6,
        rope_theta=1000000.0, tie_word_embeddings=True, hidden_act="silu", use_sliding_window=False,
    ),
    # Qwen/Qwen2.5-3B's config.json: the seed's scale. PACT arms quantize it while building it (`build_quantized`)
    "qwen2.5-3b": dict(
        model_type="qwen2", hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
        num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768, rms_norm_eps=1e-6,
        rope_theta=1000000.0, tie_word_embeddings=True, hidden_act="silu", use_sliding_window=False,
    ),
    "tiny-llama": dict(  # --quick: the same code paths in seconds
        model_type="llama", hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=4, vocab_size=8192, max_position_embeddings=4096, tie_word_embeddings=True,
    ),
    "smollm2-135m": None,  # real weights: the default model, `REAL_WEIGHTS`
    "qwen2.5-coder-1.5b": None,  # real weights: the named model (`pact finetune --model qwen2.5-coder-1.5b`)
}  # fmt: skip
# The architectures with real weights: the `--model` value each is resolved from (None: the default model)
REAL_WEIGHTS = {"smollm2-135m": None, "qwen2.5-coder-1.5b": "qwen2.5-coder-1.5b"}
# The configurations issue 4 asks for: (arch, seq, arms, arms measured on fake tensors).
CONFIGS = [
    ("qwen2.5-0.5b", 3072, ARMS, ()),
    # at 4k the baseline does not fit 24 GiB (fake tensors); nvfp4 without savers is only 1.7 GiB smaller: left out
    ("qwen2.5-0.5b", 4096, ("baseline", "checkpoint", "subset", "mask"), ("baseline",)),
    ("llama-3.2-1b", 2048, ARMS, ()),
    ("smollm2-135m", 2048, ARMS, ()),
]
GIB = 2**30


QUANTIZED_WHILE_BUILT = ("qwen2.5-3b",)  # fp32 weights of the whole model never exist at once
LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


# ---------------------------------------------------------------- one arm (runs in its own process)
def build_quantized(arch: str, r: int, tile_size: int | None):
    """A PACT model of `arch` with random weights, built on the meta device and materialized one linear at a time:
    each decoder linear gets its fp32 weight (normal, std 0.02, as transformers initializes) and is quantized to an
    NVFP4 `FrozenLinear` at once, so at most one linear's fp32 weight exists. Embedding (tied output head) fp32
    random, norms 1, rotary frequencies computed; then `get_peft_model` wraps the FrozenLinears with LoRA."""
    import torch
    from peft import get_peft_model
    from torch import nn
    from transformers import AutoConfig, AutoModelForCausalLM

    from optimum_pact.dataflow import FrozenLinear
    from peft_ext import PactConfig

    numbers = dict(ARCHS[arch])
    config = AutoConfig.for_model(numbers.pop("model_type"), **numbers)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    pact = PactConfig(r=r, lora_alpha=2 * r, target_modules=LINEARS, backend_options={"tile_size": tile_size})
    backend, gen = pact.get_backend(), torch.Generator().manual_seed(0)
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in LINEARS:
            linear = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None)
            with torch.no_grad():
                linear.weight.normal_(0.0, config.initializer_range, generator=gen)
                if linear.bias is not None:
                    linear.bias.zero_()
            parent, child = name.rsplit(".", 1)
            setattr(model.get_submodule(parent), child, FrozenLinear.from_linear(linear, backend=backend))
            del linear
    embed = model.get_input_embeddings()
    embed.weight = nn.Parameter(torch.empty(embed.weight.shape).normal_(0.0, config.initializer_range, generator=gen))
    model.model.rotary_emb = type(model.model.rotary_emb)(config=config)
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for key, t in list(table.items()):
                if t is not None and t.is_meta:  # the norms
                    ones = torch.ones(t.shape)
                    table[key] = nn.Parameter(ones, requires_grad=False) if table is module._parameters else ones
    model.tie_weights()
    model = get_peft_model(model, pact)
    model.train()
    return model


def build(arch: str, arm: str, r: int, tile_size: int | None, real_weights: bool = True):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from peft_ext import PactConfig

    torch.manual_seed(0)
    if arch in QUANTIZED_WHILE_BUILT and arm != "baseline" and real_weights:
        return build_quantized(arch, r, tile_size)
    if ARCHS[arch] is None:
        from optimum_pact.commands.model_folder import resolve_model

        path = resolve_model(REAL_WEIGHTS[arch])
        if real_weights:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
            for t in [*model.parameters(), *model.buffers()]:  # out of the safetensors mapping, which otherwise
                t.data = t.data.clone()  # stays resident (RssFile) as long as one small tensor (a norm) views it
        else:
            config = AutoConfig.from_pretrained(path)
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    else:
        numbers = dict(ARCHS[arch])
        config = AutoConfig.for_model(numbers.pop("model_type"), **numbers)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    lora = dict(r=r, lora_alpha=2 * r, target_modules="all-linear")
    config = LoraConfig(**lora) if arm == "baseline" else PactConfig(**lora, backend_options={"tile_size": tile_size})
    model = get_peft_model(model, config)
    model.train()
    return model


def batch(vocab_size: int, seq: int, trainable: float):
    import torch

    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab_size, (1, seq), generator=gen)
    labels = ids.clone()
    labels[:, : seq - max(1, round(seq * trainable))] = -100  # the prompt part gets no loss
    return ids, labels


def step(model, ids, labels) -> float:
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    return loss.detach().item() if not _is_fake(loss) else float("nan")


def _is_fake(t) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def run_idle() -> dict:
    import peft  # noqa: F401  the same imports as an arm
    import torch  # noqa: F401
    import transformers  # noqa: F401

    import optimum_pact.memory  # noqa: F401
    import peft_ext  # noqa: F401

    trim_memory()
    reset_peak_rss()
    return {"idle_rss_bytes": status_bytes("VmHWM")}


def run_arm(
    arch: str,
    arm: str,
    seq: int,
    r: int,
    trainable: float,
    tile_size,
    offload_dir,
    fake: bool,
    cache_mib: float,
    resident_only: bool = False,
) -> dict:
    import torch

    from optimum_pact.memory import LiveTensorTracker, MemorySavers, fake_peak, module_tensors
    from optimum_pact.memory.streaming import mapping_resident_bytes, release_mapping

    torch.set_num_threads(2)
    result = {"arch": arch, "arm": arm, "seq": seq, "mode": "fake" if fake else "real"}
    if fake:
        import peft  # noqa: F401  imported here, not first inside the meta-device context of fake_peak
        import transformers  # noqa: F401

        import peft_ext  # noqa: F401

        if SAVERS[arm] is not None or arm != "baseline":
            raise SystemExit(f"--fake-arms supports the baseline only (got {arm}): PACT arms quantize real weights.")

        def fake_step(model):
            ids, labels = batch(model.config.vocab_size, seq, trainable)
            step(model, ids, labels)

        start = time.perf_counter()
        out = fake_peak(lambda: build(arch, arm, r, tile_size, real_weights=False), fake_step)
        return {**result, "live_peak_bytes": out["peak_bytes"], "weights_bytes": out["weights_bytes"],
                "accounting_s": time.perf_counter() - start}  # fmt: skip

    model = build(arch, arm, r, tile_size)
    ids, labels = batch(model.config.vocab_size, seq, trainable)
    savers, mapped = None, []
    if SAVERS[arm] is not None:
        savers = MemorySavers(model, offload_dir=offload_dir, cache_mib=cache_mib, **SAVERS[arm])
        mapped = savers.mapped_weights
        if savers.neighbours is not None:  # once per vocabulary (here: per target id), not per step
            start = time.perf_counter()
            savers.neighbours.precompute(labels[labels != -100])
            result["neighbours_s"] = time.perf_counter() - start
    trim_memory()
    result["rss_before_bytes"] = status_bytes("VmRSS")
    reset_peak_rss()
    start, cpu = time.perf_counter(), time.process_time()
    result["loss"] = step(model, ids, labels)
    result["step_s"] = time.perf_counter() - start
    result["step_cpu_s"] = time.process_time() - cpu  # less sensitive than wall time to a busy machine
    result["vmhwm_bytes"] = status_bytes("VmHWM")
    weights_file = savers.weights_file if savers is not None else None
    if weights_file is not None:
        result["mapped_resident_after_step_bytes"] = mapping_resident_bytes(weights_file)
        if savers.stream is not None:
            result["mapped_resident_peak_bytes"] = savers.stream.peak_resident_bytes  # sampled every 8th release
            result["stream_releases"] = savers.stream.releases
        savers.stop_streaming()  # the tracked step below also measures what a step touches of the mapping
        release_mapping(weights_file)
    if resident_only:  # the headline only: no second (tracked) step
        result["mapped_bytes"] = sum(t.numel() * t.element_size() for t in mapped)
        if savers is not None:
            savers.close()
        return result
    model.zero_grad(set_to_none=True)
    trim_memory()
    with LiveTensorTracker([*module_tensors(model), ids, labels], mapped=mapped, breakdown=True) as tracker:
        result["weights_bytes"] = tracker.live_bytes
        step(model, ids, labels)
    result["live_peak_bytes"] = tracker.peak_bytes
    result["mapped_bytes"] = tracker.mapped_bytes
    if weights_file is not None:
        result["mapped_touched_bytes"] = mapping_resident_bytes(weights_file)  # every page the step read
    top = sorted(tracker.peak_breakdown.items(), key=lambda kv: -kv[1])[:8]  # within 1% of the peak
    result["peak_by_op_mib"] = {name: round(size / 2**20, 1) for name, size in top}
    if savers is not None:
        if savers.offloader is not None:
            result["offloaded_bytes_per_step"] = savers.offloader.bytes_written // 2
            result["offload_files_left"] = len(savers.offloader.live_files())
        savers.close()
    return result


# ---------------------------------------------------------------- driver
def _child(extra: list[str], malloc_mmap_threshold: int = 0) -> dict:
    cmd = [sys.executable, __file__, *extra]
    env = dict(os.environ)
    if malloc_mmap_threshold:
        env["MALLOC_MMAP_THRESHOLD_"] = str(malloc_mmap_threshold)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def measure(arch: str, seq: int, arms, fake_arms, args) -> dict:
    common = ["--r", str(args.r), "--trainable", str(args.trainable), "--seq", str(seq), "--arch", arch]
    if args.tile_size:
        common += ["--tile-size", str(args.tile_size)]
    common += ["--cache-mib", str(args.cache_mib)] + (["--resident-only"] if args.resident_only else [])
    if args.offload_dir:
        common += ["--offload-dir", args.offload_dir]
    idle = _child(["--idle"], args.malloc_mmap_threshold)["idle_rss_bytes"]
    runs = {}
    for arm in arms:
        extra = ["--arm", arm, *common, *(["--fake"] if arm in fake_arms else [])]
        runs[arm] = _child(extra, args.malloc_mmap_threshold)
        run = runs[arm]
        hwm = f"{(run['vmhwm_bytes'] - idle) / GIB:7.3f}" if "vmhwm_bytes" in run else "   fake"
        step_s = f"{run['step_s']:7.2f}" if "step_s" in run else "      -"
        live, weights = run.get("live_peak_bytes", float("nan")) / GIB, run.get("weights_bytes", float("nan")) / GIB
        touched = run.get("mapped_touched_bytes", 0) / GIB
        line = (f"VmHWM-idle {hwm} GiB, live peak {live:7.3f} GiB (weights {weights:.3f}) + mapped touched "
                f"{touched:.3f}, step {step_s} s")  # fmt: skip
        print(f"{arch} seq {seq} {arm:>15}: {line}", file=sys.stderr)
    return summarize(arch, seq, runs, idle, args)


def summarize(arch: str, seq: int, runs: dict, idle: int, args) -> dict:
    live = {arm: run["live_peak_bytes"] / GIB for arm, run in runs.items() if "live_peak_bytes" in run}
    hwm = {arm: (run["vmhwm_bytes"] - idle) / GIB for arm, run in runs.items() if "vmhwm_bytes" in run}
    step_s = {arm: run["step_s"] for arm, run in runs.items() if "step_s" in run}
    touched = {arm: run.get("mapped_touched_bytes", 0) / GIB for arm, run in runs.items()}
    live_mapped = {arm: live[arm] + touched[arm] for arm in live}
    base = "baseline"
    # the headline: resident memory as the kernel counts it (VmHWM above an idle process, mapped pages included);
    # a baseline too large to run is counted by its fake-tensor live peak, which is below its VmHWM (conservative)
    resident = dict(hwm)
    if base in runs and base not in hwm:
        resident[base] = live[base]
    out = {
        "bench": "memory", "arch": arch, "seq": seq, "r": args.r, "trainable": args.trainable,
        "resident_gib": resident,
        "resident_ratio_vs_baseline": {arm: resident[base] / v for arm, v in resident.items()}
        if base in resident else {},
        "baseline_resident_from": "VmHWM - idle" if base in hwm else "fake-tensor live peak (too large to run)",
        "headline": {arm: resident[base] / resident[arm] for arm in HEADLINE if arm in resident and base in resident},
        "live_plus_mapped_touched_gib": live_mapped,
        "live_plus_mapped_ratio_vs_baseline": {arm: live_mapped[base] / v for arm, v in live_mapped.items()}
        if base in live_mapped else {},
        "mapped_touched_gib": touched,
        "mapped_resident_after_step_gib": {arm: run["mapped_resident_after_step_bytes"] / GIB
                                           for arm, run in runs.items() if "mapped_resident_after_step_bytes" in run},
        "mapped_resident_peak_gib": {arm: run["mapped_resident_peak_bytes"] / GIB
                                     for arm, run in runs.items() if "mapped_resident_peak_bytes" in run},
        "streaming_step_time_ratio": step_s["mask"] / step_s["mask_unstreamed"]
        if "mask" in step_s and "mask_unstreamed" in step_s else None,
        "cpu": cpu_model(),
        "modes": {arm: run["mode"] for arm, run in runs.items()},
        "live_peak_gib": live,
        "weights_gib": {arm: run["weights_bytes"] / GIB for arm, run in runs.items() if "weights_bytes" in run},
        "mapped_gib": {arm: run.get("mapped_bytes", 0) / GIB for arm, run in runs.items()},
        "vmhwm_minus_idle_gib": hwm, "idle_rss_gib": idle / GIB, "step_s": step_s,
        "step_growth_gib": {arm: (run["vmhwm_bytes"] - run["rss_before_bytes"]) / GIB
                            for arm, run in runs.items() if "vmhwm_bytes" in run},
        "live_ratio_vs_baseline": {arm: live[base] / v for arm, v in live.items()} if base in live else {},
        "vmhwm_ratio_vs_baseline": {arm: hwm[base] / v for arm, v in hwm.items()} if base in hwm else {},
    }  # fmt: skip
    order = [arm for arm in ARMS[:5] if arm in step_s]  # the cumulative stack
    out["step_time_vs_previous_arm"] = {b: step_s[b] / step_s[a] for a, b in zip(order, order[1:])}
    extras = ("step_cpu_s", "mapped_bytes", "neighbours_s", "offloaded_bytes_per_step", "offload_files_left", "loss",
              "peak_by_op_mib", "stream_releases")  # fmt: skip
    out["details"] = {arm: {k: run[k] for k in extras if k in run} for arm, run in runs.items()}
    return out


def validate_fake(arch: str, seq: int, args) -> dict:
    """The baseline's live peak measured for real and on fake tensors, at a size that fits."""
    common = ["--r", str(args.r), "--trainable", str(args.trainable), "--seq", str(seq), "--arch", arch]
    real = _child(["--arm", "baseline", *common], args.malloc_mmap_threshold)["live_peak_bytes"]
    fake = _child(["--arm", "baseline", "--fake", *common], args.malloc_mmap_threshold)["live_peak_bytes"]
    return {"bench": "memory_fake_validation", "arch": arch, "seq": seq, "real_live_peak_bytes": real,
            "fake_live_peak_bytes": fake, "relative_difference": (fake - real) / real}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arm", choices=ARMS, help=argparse.SUPPRESS)  # internal: one arm in this process
    parser.add_argument("--fake", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--idle", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="tiny model at 512 tokens, plus the fake validation")
    parser.add_argument("--arch", choices=list(ARCHS))
    parser.add_argument("--seq", type=int)
    parser.add_argument("--arms", default=",".join(ARMS), help="comma-separated subset of " + ",".join(ARMS))
    parser.add_argument("--fake-arms", default="", help="arms measured on fake tensors (baseline only)")
    parser.add_argument("--validate-fake", action="store_true", help="baseline real vs fake at --arch/--seq")
    parser.add_argument("--r", type=int, default=16)
    parser.add_argument("--trainable", type=float, default=0.3, help="fraction of tokens with labels")
    parser.add_argument("--tile-size", type=int, default=256, help="the torch backend's tile_size for the NVFP4 arms")
    parser.add_argument("--offload-dir", default=None, help="default: a temporary folder")
    parser.add_argument("--cache-mib", type=float, default=0.0, help="MemorySavers cache_mib (attention cache)")
    parser.add_argument(
        "--malloc-mmap-threshold", type=int, default=65536, help="glibc MALLOC_MMAP_THRESHOLD_ for every arm process "
        "(0: glibc's default, which raises the threshold up to 32 MiB and keeps freed tensors in the heap)",
    )  # fmt: skip
    parser.add_argument(
        "--resident-only", action="store_true", help="one (timed) step per real arm: the resident figure only, no "
        "tracked step for the live peak (for sizes where a step takes long)",
    )  # fmt: skip
    parser.add_argument("--output", help="a folder: also write the configurations' lines there (results.json)")
    parser.add_argument("--quality", action="store_true", help="the quality guard: SmolLM2 fine-tune, both stacks")
    parser.add_argument("--quality-steps", type=int, default=60)
    parser.add_argument("--quality-seeds", type=int, default=3, help="seeds (data order, LoRA init) averaged")
    parser.add_argument(
        "--quality-arms", default="baseline,full", help="first and last are compared; of " + ",".join(QUALITY_ARMS)
    )
    parser.add_argument("--quality-batch", type=int, default=8)
    parser.add_argument("--quality-lr", type=float, default=2e-3)
    parser.add_argument("--quality-out", default="bench_memory_quality", help="prefix of the .png / .csv written")
    args = parser.parse_args()

    if args.quality:
        settings = (args.quality_steps, args.quality_batch, args.quality_lr, args.quality_out, args.quality_seeds)
        print(json.dumps(quality_guard(*settings, tuple(args.quality_arms.split(",")))))
        return
    if args.idle:
        print(json.dumps(run_idle()))
        return
    if args.arm:
        with tempfile.TemporaryDirectory(prefix="bench-memory-", dir=args.offload_dir) as tmp:
            print(json.dumps(run_arm(args.arch, args.arm, args.seq, args.r, args.trainable, args.tile_size, tmp,
                                     args.fake, args.cache_mib, args.resident_only)))  # fmt: skip
        return
    arms = [a for a in args.arms.split(",") if a]
    fake_arms = [a for a in args.fake_arms.split(",") if a]
    unknown = set(arms + fake_arms) - set(ARMS)
    if unknown:
        parser.error(f"unknown arms {sorted(unknown)}; choose from {', '.join(ARMS)}")
    if args.quick:
        arch, seq = args.arch or "tiny-llama", args.seq or 512
        print(json.dumps(validate_fake(arch, seq, args)))
        print(json.dumps(measure(arch, seq, arms, fake_arms, args)))
        return
    if args.validate_fake:
        print(json.dumps(validate_fake(args.arch, args.seq, args)))
        return
    configs = [(args.arch, args.seq, arms, fake_arms)] if args.arch else CONFIGS
    lines = []
    for arch, seq, config_arms, fakes in configs:
        if seq is None:
            parser.error("--arch needs --seq")
        lines.append(measure(arch, seq, config_arms, fakes, args))
        print(json.dumps(lines[-1]), flush=True)
        if args.output:  # after every configuration: a long run keeps what it measured
            out = Path(args.output) / "results.json"
            out.parent.mkdir(parents=True, exist_ok=True)
            command = "python benchmarks/bench_memory.py " + " ".join(sys.argv[1:])
            where = {"cpu": cpu_model(), "date": time.strftime("%Y-%m-%d")}  # what docs/benchmarks.md names
            out.write_text(
                json.dumps({"bench": "memory", "command": command, **where, "configurations": lines}, indent=1)
            )


if __name__ == "__main__":
    main()
