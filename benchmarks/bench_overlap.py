"""Overlap: the backend's frozen products beside the CPU's side of the step, measured in one run.

A LoRA training step (forward, backward, AdamW) of SmolLM2-135M's architecture cut to `--layers` decoder blocks
(random weights: speed only), batch 1 x `--tokens`, r=16 on all linears, on `--backend` (default qnn: on x86_64 the
HTP emulator, whose timings stand for an NPU only in that the products run outside the CPU's Python thread).
Arms, interleaved round by round: sequential (overlap off), overlapped (on), sequential again (noise arm).
Each product is timed where it runs, so per step:

* `backend_s`: time inside the frozen-weight products (forward + input gradient) in the sequential arm;
* `cpu_s` = step - backend_s: everything else (embedding, norms, attention, activations, adapter path, loss,
  optimizer), the CPU side;
* `step_vs_sum` = overlapped step / (backend_s + cpu_s): below 1 when the two really run at once;
* `cpu_hidden` = (sequential - overlapped) / cpu_s: the share of the CPU side hidden behind the backend.

Only the adapter path (a small part of the CPU side) runs beside the products, so `cpu_hidden` is bounded by the
adapter path's share. Prints one JSON line (medians over rounds).

    python benchmarks/bench_overlap.py [--backend qnn] [--layers 2] [--tokens 128] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time


def build(backend: str, overlap: bool, layers: int, r: int):
    import torch
    from peft import get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from peft_ext import PactConfig

    torch.manual_seed(0)
    config = LlamaConfig(  # SmolLM2-135M's published numbers, fewer blocks
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=layers,
        num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True, rms_norm_eps=1e-5,
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    lora = PactConfig(r=r, lora_alpha=2 * r, target_modules="all-linear", backend=backend, overlap=overlap)
    return get_peft_model(model, lora)


class ProductTimer:
    """Wraps a backend's products and adds up the seconds spent inside them (whichever thread runs them)."""

    def __init__(self, backend):
        self.backend, self.seconds, self.lock = backend, 0.0, threading.Lock()
        for name in ("forward", "input_grad"):
            setattr(self, name, self._timed(getattr(backend, name)))
        self.name, self.counts, self.prepare = backend.name, backend.counts, backend.prepare
        self.requested, self.reason, self.runs_beside_cpu = backend.requested, backend.reason, backend.runs_beside_cpu
        self.dense_weight_dtype = backend.dense_weight_dtype

    def _timed(self, product):
        def run(*args):
            start = time.perf_counter()
            try:
                return product(*args)
            finally:
                with self.lock:
                    self.seconds += time.perf_counter() - start

        return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="qnn")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--r", type=int, default=16)
    args = parser.parse_args()

    import torch

    from optimum_pact.dataflow import FrozenLinear

    torch.set_num_threads(2)
    arms = {"sequential": False, "overlapped": True, "sequential_dup": False}
    runs = {}
    for arm, overlap in arms.items():
        model = build(args.backend, overlap, args.layers, args.r)
        timers = {}
        for m in model.modules():
            if isinstance(m, FrozenLinear):
                m.backend = timers.setdefault(id(m.backend), ProductTimer(m.backend))
        params = [p for p in model.parameters() if p.requires_grad]
        runs[arm] = (model, list(timers.values()), torch.optim.AdamW(params, lr=1e-4))
    ids = torch.randint(0, 49152, (1, args.tokens), generator=torch.Generator().manual_seed(0))
    results = {arm: {"step": [], "backend": []} for arm in arms}
    for round_ in range(args.rounds + 1):  # round 0 warms up (graph compilation, caches)
        for arm, (model, timers, opt) in runs.items():
            for t in timers:
                t.seconds = 0.0
            start = time.perf_counter()
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
            step = time.perf_counter() - start
            if round_:
                results[arm]["step"].append(step)
                results[arm]["backend"].append(sum(t.seconds for t in timers))
    med = {arm: {k: statistics.median(v) for k, v in r.items()} for arm, r in results.items()}
    seq, ovl = med["sequential"], med["overlapped"]
    cpu = seq["step"] - seq["backend"]
    print(
        json.dumps(
            {
                "bench": "overlap",
                "backend": args.backend,
                "layers": args.layers,
                "tokens": args.tokens,
                "rounds": args.rounds,
                "sequential_step_s": round(seq["step"], 4),
                "overlapped_step_s": round(ovl["step"], 4),
                "noise_arm_step_s": round(med["sequential_dup"]["step"], 4),
                "backend_s": round(seq["backend"], 4),
                "cpu_s": round(cpu, 4),
                "cpu_share": round(cpu / seq["step"], 4),
                "step_vs_sum": round(ovl["step"] / (seq["backend"] + cpu), 4),
                "cpu_hidden": round((seq["step"] - ovl["step"]) / cpu, 4),
                "noise_ratio": round(med["sequential_dup"]["step"] / seq["step"], 4),
            }
        )
    )


if __name__ == "__main__":
    main()
