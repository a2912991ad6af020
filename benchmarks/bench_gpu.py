"""The CUDA path on a GPU: the Triton NVFP4 kernels against dense bf16 cuBLAS, and one LoRA training step.

On the GPU machine lent here (no network; its image has CUDA torch, triton and accelerate, but no bitsandbytes and
an older transformers than this project's), from the repo root. Here, once, the wheels it lacks (about 58 MB; they
and the working tree must stay within the 64 MiB that travels):

    echo /.whl/ >> .git/info/exclude
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_24_x86_64 -d .whl transformers==5.24.0 peft==0.21.2 bitsandbytes==0.50.2

Then there, carrying `.whl` (about 5 minutes on an H100; `--quick` about 2):

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && \
        PYTHONPATH=/tmp/site:. python3 benchmarks/bench_gpu.py --check --output $OUT

Elsewhere: `pip install -e ".[gpu,bnb]"` in a CUDA torch environment, then the same `bench_gpu.py --check`.

`--check` first runs the numerics on the device: each kernel (forward `x @ deq(W).T`, input gradient `dy @ deq(W)`)
against the reference product in bf16, fp16 and fp32 on a few shapes (within one rounding of the dtype), its
effective weights against `dequantize` bit for bit, and FrozenLinear's forward + backward through the kernels against
the torch path on the same GPU; a mismatch stops the run with exit status 1 before anything is timed. Then:
  products    each linear of SmolLM2-135M and Qwen2.5-0.5B at 512 and 4096 tokens, forward and input gradient:
              `pact` (the torch backend, so the Triton kernels), `dense` (bf16 torch.matmul: cuBLAS), `dense_dup`
              (the same again: the noise floor) and `pact_torch` (the weight dequantized per product, then cuBLAS:
              PACT_DISABLE_TRITON=1's path); CUDA events, median over interleaved rounds
  train step  SmolLM2-135M (4 x 512; its cached weights where this machine has them, else random weights from its
              config: the JSON says which) and the Qwen2.5-0.5B architecture (random weights, 2 x 1024), r=16 on all
              linears, AdamW: `pact` (PactConfig), `pact_torch`, `lora` (peft bf16), `qlora_nf4` (peft +
              bitsandbytes nf4; skipped, and said so, without bitsandbytes), `lora_dup`; median step time and peak
              GPU memory (torch.cuda.max_memory_allocated, reset per arm), arms rotated per session
Also the GPU (name, capability, driver), torch / CUDA / triton versions, and whether torch has an FP4 scaled matmul
on this device (torch._scaled_mm on float4_e2m1fn_x2: Blackwell). Progress goes to stderr; stdout gets ONE JSON line.

    python benchmarks/bench_gpu.py --check [--quick] [--output DIR] [--skip-train]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import QWEN25_05B, log

SMOLLM2_135M = dict(
    hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
    head_dim=64, vocab_size=49152, max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
    tie_word_embeddings=True,
)  # fmt: skip
LAYERS = {  # (in_features, out_features) of each linear of a block; k and v: kv heads x head_dim 64
    "smollm2-135m": {"q": (576, 576), "k": (576, 192), "v": (576, 192), "o": (576, 576),
                     "gate": (576, 1536), "up": (576, 1536), "down": (1536, 576)},
    "qwen2.5-0.5b": {"q": (896, 896), "k": (896, 128), "v": (896, 128), "o": (896, 896),
                     "gate": (896, 4864), "up": (896, 4864), "down": (4864, 896)},
}  # fmt: skip
DEVICE = "cuda"
TOKENS = (512, 4096)
PRODUCT_ARMS = ("pact", "dense", "dense_dup", "pact_torch")
TRAIN_SIZES = {"smollm2-135m": (4, 512), "qwen2.5-0.5b": (2, 1024)}  # batch, sequence
TRAIN_ARMS = ("pact", "lora", "qlora_nf4", "lora_dup", "pact_torch")
CHECK_SHAPES = [(1, 576, 192), (37, 1536, 576), (512, 576, 1536), (300, 4864, 896), (129, 896, 4864)]  # M, N, K


def gpu_info(torch) -> dict:
    """The GPU, its driver and the software versions, and whether torch multiplies FP4 on it."""
    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=60).stdout.strip()  # fmt: skip
    except (OSError, subprocess.SubprocessError) as err:
        driver = f"unknown (nvidia-smi: {err})"
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {
        "name": torch.cuda.get_device_name(),
        "capability": ".".join(map(str, torch.cuda.get_device_capability())),
        "memory_gib": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1),
        "driver": driver,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton_version,
        "fp4_scaled_mm": fp4_scaled_mm(torch),
    }


def fp4_scaled_mm(torch) -> dict:
    """Whether torch._scaled_mm multiplies float4_e2m1fn_x2 (NVFP4: e4m3 scales per 16) on this device."""
    if not hasattr(torch, "float4_e2m1fn_x2"):
        return {"available": False, "why": f"torch {torch.__version__} has no float4_e2m1fn_x2"}
    m = n = 128
    k = 128
    try:
        a = torch.zeros(m, k // 2, dtype=torch.uint8, device=DEVICE).view(torch.float4_e2m1fn_x2)
        b = torch.zeros(n, k // 2, dtype=torch.uint8, device=DEVICE).view(torch.float4_e2m1fn_x2)
        scale = torch.ones(m * k // 16, device=DEVICE).to(torch.float8_e4m3fn)  # 128 x 8: already in blocked layout
        torch._scaled_mm(a, b.t(), scale, scale.clone(), out_dtype=torch.bfloat16)
        torch.cuda.synchronize()
        return {"available": True, "why": "torch._scaled_mm ran on float4_e2m1fn_x2 operands"}
    except Exception as err:  # any refusal is the answer
        return {"available": False, "why": f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"}


def _excess(torch, got, a, w) -> float:
    """max |got - ref| / (one rounding of a's dtype at |ref| + fp32 summation error), ref = the reference product of
    `a` and `w` (w already in a's dtype): <= 1 is within one rounding (tests/test_triton_kernels.py's measure)."""
    ref = (a.float() @ w.float().T).to(a.dtype).double()
    bound = torch.finfo(a.dtype).eps * ref.abs() + a.shape[-1] * 2.0**-24 * (a.double().abs() @ w.double().abs().T)
    return float(((got.double() - ref).abs() / (bound + 1e-30)).max())


def check_fallback(torch, failures: list[str]) -> dict:
    """The guard a run relies on: the self-check passes on this GPU in each dtype, and a kernel that fails at launch
    (a fault put in here) sends the products down the torch path, equal to PACT_DISABLE_TRITON=1's, said once."""
    from optimum_pact.backends import triton_dispatch as dispatch
    from optimum_pact.backends.torch_backend import TorchBackend
    from optimum_pact.nvfp4 import quantize

    found = {str(dtype): dispatch.self_check(torch.device(DEVICE), dtype) for dtype in dispatch.DTYPES}
    failures += [f"self-check: {why}" for why in found.values() if why is not None]
    weight = quantize(torch.randn(576, 1536, device=DEVICE) * 0.05)
    x = torch.randn(7, 1536, device=DEVICE, dtype=torch.bfloat16)
    os.environ["PACT_DISABLE_TRITON"] = "1"
    want = TorchBackend().forward(x, weight)
    os.environ.pop("PACT_DISABLE_TRITON")
    kernels, real = dispatch.kernels(), dispatch.kernels().forward

    def broken(*args, **kwargs):
        raise RuntimeError("launch failed (a fault put here by bench_gpu.py --check)")

    kernels.forward = broken
    try:
        backend = TorchBackend()
        got = backend.forward(x, weight)
    finally:
        kernels.forward = real
    why = dispatch.disabled_because()
    dispatch._state.update(why=None, checked=set())
    fell_back = torch.equal(got, want) and "triton_forward" not in backend.counts and "launch failed" in (why or "")
    if not fell_back:
        failures.append(f"a failing kernel did not fall back to the torch path (counts {dict(backend.counts)})")
    return {"self_check": found, "fallback_equal_to_torch_path": fell_back}


def check(torch) -> dict:
    """The kernels' numerics on this device; raises SystemExit(1) after printing the failures."""
    from optimum_pact.backends import get_backend
    from optimum_pact.backends.triton_dispatch import kernels
    from optimum_pact.dataflow import FrozenLinear
    from optimum_pact.nvfp4 import dequantize, quantize

    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 reference in full fp32, as the kernels sum
    tk, failures, worst = kernels(), [], {}
    for m, n, k in CHECK_SHAPES:
        torch.manual_seed(m + n + k)
        weight = quantize(torch.randn(n, k, device=DEVICE) * 0.05)
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            w = dequantize(weight.qdata, weight.scale, weight.scale_2, dtype)  # bit-exact with the reference
            x, dy = torch.randn(m, k, device=DEVICE).to(dtype), torch.randn(m, n, device=DEVICE).to(dtype)
            for name, excess in (("forward", _excess(torch, tk.forward(x, weight), x, w)),
                                 ("input_grad", _excess(torch, tk.input_grad(dy, weight), dy, w.T))):  # fmt: skip
                case = f"{name} {str(dtype)[6:]} {m}x{n}x{k}"
                worst[case] = round(excess, 3)
                if not excess <= 1:
                    failures.append(f"{case}: {excess:.2f} roundings from the reference")
            if k <= 1536:  # the effective weights: an identity's product is deq(W) itself
                eye_ok = torch.equal(tk.forward(torch.eye(k, dtype=dtype, device=DEVICE), weight), w.T)
                eye_ok &= torch.equal(tk.input_grad(torch.eye(n, dtype=dtype, device=DEVICE), weight), w)
                if not eye_ok:
                    failures.append(f"weights {str(dtype)[6:]} {n}x{k}: not dequantize's bit for bit")
    torch.manual_seed(0)
    m, n, k = CHECK_SHAPES[-1]
    linear = torch.nn.Linear(k, n, bias=False, dtype=torch.bfloat16, device=DEVICE)
    layer = FrozenLinear.from_linear(linear, backend=get_backend("torch"))
    x0, grad = torch.randn(2, m, k, device=DEVICE, dtype=torch.bfloat16), torch.randn(2, m, n, device=DEVICE)
    results = []
    for disable in ("", "1"):
        os.environ["PACT_DISABLE_TRITON"] = disable
        x = x0.clone().requires_grad_()
        y = layer(x)
        y.backward(grad.to(y.dtype))
        results.append((y.detach().double(), x.grad.double()))
    os.environ.pop("PACT_DISABLE_TRITON")
    counts = dict(layer.backend.counts)
    rel = [float((a - b).abs().max() / b.abs().max()) for a, b in zip(*results)]
    if counts.get("triton_forward") != 1 or counts.get("triton_input_grad") != 1:
        failures.append(f"FrozenLinear on CUDA did not run the kernels once each: counts {counts}")
    if not max(rel) < 2**-7:
        failures.append(f"FrozenLinear through the kernels vs the torch path: relative difference {rel}")
    guard = check_fallback(torch, failures)
    report = {"pass": not failures, "failures": failures, "worst_excess": max(worst.values()), "cases": worst,
              "frozen_linear_vs_torch_path": rel, "self_check_and_fallback": guard}  # fmt: skip
    if failures:
        print(json.dumps({"bench": "gpu", "check": report}))
        log("CHECK FAILED:\n  " + "\n  ".join(failures))
        raise SystemExit(1)
    log(f"check passed: {len(worst)} kernel cases, worst {report['worst_excess']} roundings; FrozenLinear {rel}")
    return report


def time_ms(torch, fn, reps: int) -> float:
    """GPU milliseconds per call of `fn`, over `reps` calls between two CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def products(torch, rounds: int, reps: int) -> dict:
    """Each unique linear shape x tokens x product, its arms interleaved in a fresh random order every round."""
    from optimum_pact.backends import get_backend
    from optimum_pact.nvfp4 import dequantize, quantize

    backend, rng, configs = get_backend("torch"), random.Random(0), {}
    shapes = sorted({shape for layers in LAYERS.values() for shape in layers.values()})
    for k, n in shapes:
        torch.manual_seed(k + n)
        w32 = torch.randn(n, k, device=DEVICE) * 0.05
        q, wb, wb_dup = quantize(w32), w32.bfloat16(), w32.bfloat16().clone()
        for tokens in TOKENS:
            x = torch.randn(tokens, k, device=DEVICE, dtype=torch.bfloat16)
            dy = torch.randn(tokens, n, device=DEVICE, dtype=torch.bfloat16)
            configs[(k, n, tokens, "forward")] = {
                "pact": lambda x=x, q=q: backend.forward(x, q),
                "dense": lambda x=x, w=wb: torch.matmul(x, w.t()),
                "dense_dup": lambda x=x, w=wb_dup: torch.matmul(x, w.t()),
                "pact_torch": lambda x=x, q=q: torch.matmul(x, dequantize(q.qdata, q.scale, q.scale_2, x.dtype).t()),
            }
            configs[(k, n, tokens, "input_grad")] = {
                "pact": lambda dy=dy, q=q: backend.input_grad(dy, q),
                "dense": lambda dy=dy, w=wb: torch.matmul(dy, w),
                "dense_dup": lambda dy=dy, w=wb_dup: torch.matmul(dy, w),
                "pact_torch": lambda dy=dy, q=q: torch.matmul(dy, dequantize(q.qdata, q.scale, q.scale_2, dy.dtype)),
            }
    for arms in configs.values():  # compile the kernels and warm cuBLAS
        for fn in arms.values():
            fn(), fn()
    times = {key: {arm: [] for arm in PRODUCT_ARMS} for key in configs}
    for r in range(rounds):
        for key, arms in configs.items():
            for arm in rng.sample(PRODUCT_ARMS, len(PRODUCT_ARMS)):
                times[key][arm].append(time_ms(torch, arms[arm], reps))
        log(f"products: round {r + 1}/{rounds}")
    ms = {key: {arm: statistics.median(t) for arm, t in arms.items()} for key, arms in times.items()}
    rows = [{"in": k, "out": n, "tokens": tokens, "product": product,
             "ms": {arm: round(v, 4) for arm, v in ms[(k, n, tokens, product)].items()},
             "tflops_pact": round(2 * tokens * k * n / ms[(k, n, tokens, product)]["pact"] / 1e9, 1),
             "pact_vs_dense": round(ms[(k, n, tokens, product)]["pact"] / ms[(k, n, tokens, product)]["dense"], 3)}
            for k, n, tokens, product in configs]  # fmt: skip
    per_block = {}  # one block's seven linears summed: what a layer of the model costs
    for model, layers in LAYERS.items():
        for tokens in TOKENS:
            for product in ("forward", "input_grad"):
                total = {
                    arm: sum(ms[(k, n, tokens, product)][arm] for k, n in layers.values()) for arm in PRODUCT_ARMS
                }
                per_block[f"{model} {tokens} {product}"] = {
                    "ms": {arm: round(v, 4) for arm, v in total.items()},
                    "pact_vs_dense": round(total["pact"] / total["dense"], 3),
                    "dup_vs_dense": round(total["dense_dup"] / total["dense"], 3),
                    "pact_torch_vs_dense": round(total["pact_torch"] / total["dense"], 3),
                }
                log(f"{model} x{tokens} {product}: pact/dense {total['pact'] / total['dense']:.3f}, "
                    f"noise {total['dense_dup'] / total['dense']:.3f}")  # fmt: skip
    return {"rounds": rounds, "reps": reps, "per_block": per_block, "rows": rows}


def model_folders(torch, root: Path) -> dict[str, tuple[str, str]]:
    """{size: (model folder, where its weights come from)}: SmolLM2's cached weights where this machine has them
    (`pact finetune` caches them; never downloaded here), else random weights from each published config."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    from optimum_pact.cache import cache_dir

    folders = {}
    cached = cache_dir() / "SmolLM2-135M-Instruct"
    if (cached / "config.json").is_file() and (cached / "model.safetensors").is_file():
        folders["smollm2-135m"] = (str(cached), f"real (the cached {cached})")
    for size, cls, config in (("smollm2-135m", (LlamaForCausalLM, LlamaConfig), SMOLLM2_135M),
                              ("qwen2.5-0.5b", (Qwen2ForCausalLM, Qwen2Config), QWEN25_05B)):  # fmt: skip
        if size in folders:
            continue
        torch.manual_seed(0)
        with torch.device(DEVICE):
            model = cls[0](cls[1](**config)).to(torch.bfloat16)
        model.save_pretrained(root / size)
        del model
        folders[size] = (str(root / size), "random (seed 0) from the published config: speed and memory only")
    torch.cuda.empty_cache()
    return folders


def build_arm(torch, arm: str, folder: str, r: int):
    """The model of one arm on the GPU, its adapters trainable (as benchmarks/bench_train_step.py builds them)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    lora = dict(r=r, lora_alpha=2 * r, target_modules="all-linear", task_type="CAUSAL_LM")
    if arm == "qlora_nf4":
        from peft import prepare_model_for_kbit_training
        from transformers import BitsAndBytesConfig

        quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, quantization_config=quant,
                                                     device_map={"": DEVICE})  # fmt: skip
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
        return get_peft_model(model, LoraConfig(**lora))
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).to(DEVICE)
    if arm.startswith("pact"):
        from peft_ext import PactConfig

        return get_peft_model(model, PactConfig(**lora)).to(DEVICE)  # quantized on the GPU, where the weights are
    return get_peft_model(model, LoraConfig(**lora)).to(DEVICE)


def run_arm(torch, arm: str, folder: str, batch: int, seq: int, steps: int, r: int) -> dict:
    """Two warm-up steps, then `steps` timed ones: median wall time per step (synchronized), the GPU memory the built
    model holds, and the peak GPU memory of the steps (reset after building)."""
    os.environ["PACT_DISABLE_TRITON"] = "1" if arm == "pact_torch" else ""
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(0)
    model = build_arm(torch, arm, folder, r)
    model.train()
    build_peak_gib = torch.cuda.max_memory_allocated() / 2**30  # PACT's includes the bf16 weights it quantized
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()  # the peak of training alone, the resident model included
    built_gib = torch.cuda.memory_allocated() / 2**30
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), device=DEVICE)
    times, losses = [], []
    for i in range(steps + 2):  # two warm-up steps: the kernels compile, cuBLAS and the allocator settle
        torch.cuda.synchronize()
        start = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if i >= 2:
            times.append(time.perf_counter() - start)
        losses.append(round(loss.item(), 4))
    counts = dict(model.peft_config["default"].get_backend().counts) if arm.startswith("pact") else {}
    result = {"step_s": statistics.median(times), "steps_s": [round(t, 4) for t in times],
              "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 3), "model_gib": round(built_gib, 3),
              "build_peak_gib": round(build_peak_gib, 3),
              "losses": losses, "backend_counts": counts}  # fmt: skip
    del model, opt, loss
    os.environ.pop("PACT_DISABLE_TRITON")
    gc.collect()
    torch.cuda.empty_cache()
    return result


def train_steps(torch, sessions: int, steps: int, r: int) -> dict:
    """Every arm on each size, `sessions` times in a rotated order; an arm that fails is left out, and said so."""
    try:
        import bitsandbytes  # noqa: F401

        arms, skipped = list(TRAIN_ARMS), {}
    except Exception as err:  # missing, or built without this GPU's CUDA
        arms = [a for a in TRAIN_ARMS if a != "qlora_nf4"]
        skipped = {"qlora_nf4": f"bitsandbytes unavailable ({type(err).__name__}: {err})"}
        log(f"qlora_nf4 skipped: {skipped['qlora_nf4']}")
    out = {"sessions": sessions, "steps": steps, "r": r, "skipped": skipped, "errors": {}}
    with tempfile.TemporaryDirectory(prefix="bench_gpu_") as tmp:
        folders = model_folders(torch, Path(tmp))
        for size, (batch, seq) in TRAIN_SIZES.items():
            folder, weights = folders[size]
            runs = {arm: [] for arm in arms}
            for s in range(sessions):
                for arm in arms[s % len(arms) :] + arms[: s % len(arms)]:  # rotated: no arm always first
                    if f"{size} {arm}" in out["errors"]:
                        continue
                    try:
                        runs[arm].append(run_arm(torch, arm, folder, batch, seq, steps, r))
                    except Exception as err:  # one arm's failure (a bitsandbytes build, memory) keeps the others
                        out["errors"][f"{size} {arm}"] = f"{type(err).__name__}: {str(err)[:500]}"
                        log(f"{size} {arm} FAILED: {out['errors'][f'{size} {arm}']}")
                        os.environ.pop("PACT_DISABLE_TRITON", None)
                        continue
                    log(f"{size} session {s}: {arm:>10} {runs[arm][-1]['step_s'] * 1e3:.1f} ms/step, "
                        f"peak {runs[arm][-1]['peak_gib']:.2f} GiB")  # fmt: skip
            done = [arm for arm in arms if runs[arm]]
            step = {arm: statistics.median(run["step_s"] for run in runs[arm]) for arm in done}
            peak = {arm: max(run["peak_gib"] for run in runs[arm]) for arm in done}
            base = "lora" if "lora" in done else done[0]
            out[size] = {
                "batch": batch, "seq": seq, "weights": weights,
                "step_ms": {arm: round(v * 1e3, 2) for arm, v in step.items()},
                "peak_gib": peak,
                f"step_vs_{base}": {arm: round(step[arm] / step[base], 3) for arm in done if arm != base},
                f"peak_vs_{base}": {arm: round(peak[arm] / peak[base], 3) for arm in done if arm != base},
                "runs": runs,
            }  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="check the kernels' numerics on the device first")
    parser.add_argument("--quick", action="store_true", help="fewer rounds, sessions and steps (about 2 minutes)")
    parser.add_argument("--skip-train", action="store_true", help="the products only, no training step")
    parser.add_argument("--r", type=int, default=16, help="LoRA rank of the training step")
    parser.add_argument("--output", help="a folder: also write the results there (results.json)")
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        sys.exit(f"bench_gpu.py needs a CUDA GPU, and torch {torch.__version__} sees none; run it on a GPU machine "
                 "(the command is at the top of benchmarks/bench_gpu.py).")  # fmt: skip
    start = time.perf_counter()
    line = {"bench": "gpu", "quick": args.quick, "date": time.strftime("%Y-%m-%d"), "gpu": gpu_info(torch)}
    from optimum_pact.backends import get_backend

    line["auto_backend"] = get_backend("auto").reason
    log(f"{line['gpu']['name']}, triton {line['gpu']['triton']}: backend='auto' chose torch: {line['auto_backend']}")
    if line["gpu"]["triton"] is None:
        sys.exit("bench_gpu.py: triton is not installed: pip install 'optimum-pact[gpu]'.")
    line["check"] = check(torch) if args.check else None
    line["products"] = products(torch, rounds=5 if args.quick else 15, reps=5 if args.quick else 10)
    save(line, args.output, start)  # what is measured so far survives a failure in the training step
    if not args.skip_train:
        sessions, steps = (1, 2) if args.quick else (2, 5)
        line["train_step"] = train_steps(torch, sessions=sessions, steps=steps, r=args.r)
    save(line, args.output, start)
    print(json.dumps(line))


def save(line: dict, output: str | None, start: float) -> None:
    """Stamp the wall time on `line` and write it to `output`/results.json where asked."""
    line["wall_s"] = round(time.perf_counter() - start, 1)
    if output:
        out = Path(output) / "results.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(line, indent=1) + "\n")


if __name__ == "__main__":
    main()
