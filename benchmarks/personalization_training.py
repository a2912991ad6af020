"""The personalization benchmark's methods: each one's model, its training loop and scoring, and the qnn check.

eval_personalization.py runs them over users and seeds; the method names are its METHODS.
"""

from __future__ import annotations

import time

from optimum_pact.nvfp4 import SCALE_RULES


def scale_rule() -> str:
    """The NVFP4 scale rule this code quantizes with (`optimum_pact.nvfp4.SCALE_RULES`, the first)."""
    return SCALE_RULES[0]


def build(method: str, path: str, args, seed: int, backend: str = "torch", compiled: bool = True):
    """The model of one method: the base in its dtype, with a LoRA (peft's, or PactConfig's) unless zero_shot."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from optimum_pact.precision import resolve_dtype
    from peft_ext import PactConfig

    lora = dict(r=args.r, lora_alpha=2 * args.r, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
    dtype = {"fp32": torch.float32, "cpu_bf16": torch.bfloat16}.get(method) or resolve_dtype(args.dtype)
    quant = None
    if method == "qlora":
        from transformers import BitsAndBytesConfig

        quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, quantization_config=quant)
    if method == "zero_shot":
        return model
    torch.manual_seed(seed)
    if method in ("pact", "pact_exact", "shared"):
        return get_peft_model(model, PactConfig(**lora, backend=backend))
    model = get_peft_model(model, LoraConfig(**lora))
    if method == "cpu_bf16" and args.compile and compiled:
        model = torch.compile(model, dynamic=True)
    return model


def optimizer(params, lr: float, steps: int):
    """AdamW with 5 warm-up steps (fewer on short runs) and linear decay: every backprop method's schedule."""
    import torch
    from transformers import get_linear_schedule_with_warmup

    opt = torch.optim.AdamW(params, lr=lr)
    return opt, get_linear_schedule_with_warmup(opt, min(5, steps // 4), steps)


def train(model, data: list[dict], lr: float) -> list[float]:
    opt, schedule = optimizer([p for p in model.parameters() if p.requires_grad], lr, len(data))
    model.train()
    losses = []
    for batch in data:
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        schedule.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def evaluate(model, tokenizer, task) -> dict:
    import lamp

    from optimum_pact.commands.evaluation import classify

    predictions = classify(model, tokenizer, [i["text"] for i in task.test], list(task.labels))
    golds = [i["label"] for i in task.test]
    return {**lamp.lamp2_metrics(predictions, golds, task.labels), "predictions": predictions}


def qnn_agreement(task, path: str, tokenizer, data, args) -> dict:
    """PACT on qnn against PACT on torch, step by step on the same parameters: loss and adapter-gradient agreement.

    The torch model trains as in `train`; before each step the qnn model takes its adapter weights, so both compute
    the loss and gradients of the same parameters on the same batch. (Letting each train on its own drifts apart
    after the first Adam step whatever the numerics: Adam's update is about lr * sign(grad), so tiny gradients
    that differ in sign move weights by a full step.)
    """
    import torch

    from optimum_pact.backends import get_backend

    try:
        get_backend("qnn")
    except (ImportError, RuntimeError) as err:
        return {"skipped": str(err)}
    seed = args.seeds[0]
    ref, npu = build("pact", path, args, seed), build("pact", path, args, seed, backend="qnn")
    params = {n: p for n, p in ref.named_parameters() if p.requires_grad}
    mirror = {n: p for n, p in npu.named_parameters() if p.requires_grad}
    opt, schedule = optimizer(params.values(), args.lr, len(data))
    steps, start = [], time.perf_counter()
    for batch in data[: args.qnn_steps]:
        with torch.no_grad():
            for name, p in mirror.items():
                p.copy_(params[name])
        losses = [m(**batch).loss for m in (ref, npu)]
        for loss in losses:
            loss.backward()
        g_ref = torch.cat([p.grad.flatten() for p in params.values()])
        g_npu = torch.cat([mirror[n].grad.flatten() for n in params])
        steps.append({
            "torch_loss": losses[0].item(), "qnn_loss": losses[1].item(),
            "loss_rel_diff": abs(losses[1].item() - losses[0].item()) / abs(losses[0].item()),
            "grad_cosine": torch.nn.functional.cosine_similarity(g_ref.double(), g_npu.double(), dim=0).item(),
            "grad_rel_error": ((g_npu - g_ref).norm() / g_ref.norm()).item(),
        })  # fmt: skip
        opt.step()
        schedule.step()
        opt.zero_grad(set_to_none=True)
        npu.zero_grad(set_to_none=True)
    return {"user": f"{task.workload}/{task.user}", "steps": steps, "seconds": time.perf_counter() - start,
            "nvfp4_scale_rule": scale_rule(),
            "max_loss_rel_diff": max(s["loss_rel_diff"] for s in steps),
            "min_grad_cosine": min(s["grad_cosine"] for s in steps)}  # fmt: skip
