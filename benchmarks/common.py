"""What several benchmarks share: the CPU they ran on, their model folders and the process's memory from /proc.

Benchmarks import from here, never from each other, so no two of them import each other in a circle
(tests/test_benchmarks_imports.py checks it).
"""

from __future__ import annotations

import ctypes
import gc
import importlib.util
import os
import platform
import subprocess
import sys
import time

# Qwen2.5-0.5B's published config numbers (random weights: speed and memory only)
QWEN25_05B = dict(
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    vocab_size=151936,
    max_position_embeddings=32768,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)
QWEN_QUICK = dict(QWEN25_05B, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                  vocab_size=1024)  # fmt: skip


def log(*args) -> None:
    print(*args, file=sys.stderr, flush=True)


def cpu_model() -> str:
    """lscpu's model name, whether AMX is there and the widest vector / bf16 support (the machines differ), e.g.
    "AMD EPYC (no AMX, AVX-512, AVX512-BF16)", and the cap where benchmarks/avx2_only.sh set one; the platform's
    processor where lscpu is missing."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    except OSError:
        return platform.processor()
    name = next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")), "?")
    flags = set(next((line.split(":", 1)[1].split() for line in out.splitlines() if line.startswith("Flags")), []))
    simd = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
    bf16 = ", AVX512-BF16" if "avx512_bf16" in flags else ""
    # benchmarks/avx2_only.sh caps torch's kernels and PACT's at AVX2: say so beside the CPU that really ran
    cap = os.environ.get("ATEN_CPU_CAPABILITY")
    capped = f" capped at {cap.upper()} by benchmarks/avx2_only.sh (an emulation)" if cap else ""
    return f"{name} ({'AMX' if 'amx_tile' in flags else 'no AMX'}, {simd}{bf16}){capped}"


def machine() -> str:
    """The machine as results files record it, e.g. "x86_64, 2 CPU cores, Linux; AMD EPYC (no AMX, AVX-512,
    AVX512-BF16)" (write_docs.machine_words reads it back)."""
    return f"{platform.machine()}, {os.cpu_count()} CPU cores, {platform.system()}; {cpu_model()}"


def model_folder(key: str, quick: bool) -> str:
    """A local model folder: the cached SmolLM2-135M, or the Qwen2.5-0.5B architecture with seed-0 random weights."""
    from optimum_pact.cache import cache_dir
    from optimum_pact.commands.default_model import ensure_default_model

    if key == "smollm2":
        return str(ensure_default_model())
    folder = cache_dir("aqlora", "qwen2.5-0.5b-arch-tiny" if quick else "qwen2.5-0.5b-arch-random")
    if not (folder / "config.json").is_file():
        import torch
        from transformers import Qwen2Config, Qwen2ForCausalLM

        log(f"building {folder.name} (random weights, seed 0, bf16) once")
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(Qwen2Config(**(QWEN_QUICK if quick else QWEN25_05B))).to(torch.bfloat16)
        partial = folder.with_name(folder.name + ".partial")
        model.save_pretrained(partial)
        partial.rename(folder)
    return str(folder)


def round_linears(model, rounding, keep=()) -> None:
    """Replace each decoder linear's weight in `model` (peft_ext.blocks.decoder_linears) by `rounding` of it in fp32,
    in place: what a 4-bit format reconstructs (optimum_pact.nvfp4.fake_quantize, peft_ext.ranking.nf4_dequantized).
    The linears named in `keep` stay as they are."""
    import torch

    from peft_ext.blocks import decoder_linears

    with torch.no_grad():
        for name, linear in decoder_linears(model).items():
            if name not in keep:
                linear.weight.copy_(rounding(linear.weight.float()))


def status_bytes(field: str) -> int:
    """A size field of /proc/self/status (VmRSS, VmHWM, ...) in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def trim_memory() -> None:
    """Collect garbage and hand glibc's free heap back to the system (no-op without glibc)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)


def llama_cpp_arm(prompt: list[int], new: int, threads: int, gguf=None):
    """A function timing llama.cpp's decode of `gguf` (default: the Q4_1 GGUF the default model comes from):
    (new - 1) / (time for `new` tokens - time for 1), greedy, batch 1, `threads` threads; None without llama.cpp."""
    if importlib.util.find_spec("llama_cpp") is None:
        return None
    from llama_cpp import Llama

    from optimum_pact.commands.default_model import default_gguf_path

    gguf = default_gguf_path() if gguf is None else gguf
    llm = Llama(model_path=str(gguf), n_threads=threads, n_ctx=512, verbose=False)

    def run() -> float:
        def timed(count):
            llm.reset()
            start = time.perf_counter()
            for i, _ in enumerate(llm.generate(prompt, temp=0.0, top_k=1)):
                if i + 1 >= count:
                    break
            return time.perf_counter() - start

        first = timed(1)
        return (new - 1) / (timed(new) - first)

    return run
