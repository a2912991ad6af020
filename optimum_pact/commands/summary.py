"""The main job's summary: what `pact finetune` prints, writes to summary.json and puts on the model card."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

from trainer_callbacks.model_card import write_model_card

from .default_model import DEFAULT_MODEL_HUB_ID, DEFAULT_MODEL_NOTE
from .rounded_base import BASE_FILE


@dataclass
class FinetuneSummary:
    model: str
    train_items: int
    heldout_items: int
    accuracy_before: float | None  # labelled data: held-out accuracy (None for generative data)
    accuracy_after: float | None
    final_loss: float
    steps: int
    steps_per_second: float
    train_seconds: float
    peak_rss_gib: float
    frozen_linears: int
    backend: str
    adapter_dir: str
    products: dict[str, int] | None = None  # frozen-weight products run in training, per backend
    fp16_linears: int = 0  # linears the precision plan kept 16-bit
    memory_saver: str = "none"  # PactTrainingArguments.pact_memory_saver
    guarded_rows: int = 0  # rows the FP16 range guard scaled down (NPU)
    background: dict | None = None  # background mode only: resume point, pauses, checkpoints
    data_format: str = "labelled"  # or chat, prompt_completion, text
    loss_before: float | None = None  # generative data: held-out loss per learned token (perplexity = exp)
    loss_after: float | None = None
    example_prompt: str | None = None  # one held-out item, answered greedily by the base and by the adapter
    answer_before: str | None = None
    answer_after: str | None = None
    dtype: str | None = None  # the compute dtype (`--dtype auto` resolved)
    fused_compile_s: float | None = None  # pact_fuse_cpu_ops: seconds spent compiling the fused CPU ops
    mapped_gib: float | None = None  # memory savers: frozen weights in a file mapping (part of the RSS when touched)
    mapped_resident_peak_gib: float | None = None  # ... the most of them seen resident at once (streamed)
    wall_seconds: float | None = None  # the whole process so far: imports, loading, quantizing, training, scoring
    rounded_linears: int = 0  # --rounding gptq: NVFP4 linears rounded by GPTQ on the training items (0: nearest)
    rounding_seconds: float | None = None  # ... and the seconds that took (in wall_seconds, not train_seconds)

    def to_dict(self) -> dict:
        out = asdict(self)
        if out["background"] is None:
            del out["background"]
        return out

    def _linears(self) -> str:
        fp16 = f" ({self.fp16_linears} kept 16-bit: precision plan, AQLoRA)" if self.fp16_linears else ""
        dtype = f", computing in {self.dtype}" if self.dtype else ""
        rounded = f", {self.rounded_linears} rounded by GPTQ on your items" if self.rounded_linears else ""
        return f"{self.frozen_linears} NVFP4-base linears{fp16}{rounded} on the {self.backend} backend{dtype}"

    def _products(self) -> str:
        counts = {name: n for name, n in (self.products or {}).items() if n}
        total = sum(counts.values())
        if len(counts) == 1:
            (name,) = counts
            text = f"{total} in training, all on {name}"
        else:
            text = f"{total} in training: " + ", ".join(f"{n} on {name}" for name, n in sorted(counts.items()))
        return text + (f"; {self.guarded_rows} rows range-guarded" if self.guarded_rows else "")

    def _rate(self) -> str:
        rate = f"{self.steps_per_second:.2f} steps/s"
        if self.fused_compile_s is None:
            return rate
        return f"{rate}; CPU ops fused, {self.fused_compile_s:.1f} s of it compiling"

    def _wall(self) -> list[tuple[str, str]]:
        if self.wall_seconds is None:
            return []
        what = "start to summary: loading, quantizing, training, scoring"
        return [("whole command", f"{self.wall_seconds:.1f} s ({what})")]

    def _savers(self) -> str:
        return "" if self.memory_saver == "none" else f" (memory savers: {self.memory_saver})"

    def _mapped(self) -> list[tuple[str, str]]:
        if self.mapped_gib is None:
            return []
        if self.mapped_resident_peak_gib is None:
            return [("mapped weights", f"{self.mapped_gib:.3f} GiB, resident once touched (not streamed)")]
        peak = self.mapped_resident_peak_gib
        return [("mapped weights", f"{self.mapped_gib:.3f} GiB, at most {peak:.3f} GiB of it resident (streamed)")]

    def _heldout(self) -> list[tuple[str, str]]:
        if self.data_format == "labelled":
            used = " (base -> the saved adapter, as pact generate runs it)"
            return [("held-out accuracy", f"{self.accuracy_before:.1%} -> {self.accuracy_after:.1%}{used}")]
        before, after = self.loss_before, self.loss_after
        return [
            ("held-out loss", f"{before:.4f} -> {after:.4f}"),
            ("held-out perplexity", f"{math.exp(before):.2f} -> {math.exp(after):.2f}"),
        ]

    def _example(self) -> list[tuple[str, str]]:
        if self.example_prompt is None:
            return []
        return [
            ("held-out prompt", repr(self.example_prompt[-120:])),
            ("  base answers", repr(self.answer_before)),
            ("  adapter answers", repr(self.answer_after)),
        ]

    def render(self) -> str:
        rows = [
            ("model", self.model),
            ("data", f"{self.train_items} train / {self.heldout_items} held-out items ({self.data_format})"),
            *self._heldout(),
            ("final training loss", f"{self.final_loss:.4f}"),
            ("steps", f"{self.steps} in {self.train_seconds:.1f} s ({self._rate()})"),
            *self._wall(),
            ("peak memory (RSS)", f"{self.peak_rss_gib:.2f} GiB" + self._savers()),
            *self._mapped(),
            ("frozen linears", self._linears()),
            ("frozen-weight products", self._products()),
            ("adapter", self.adapter_dir),
        ]
        if self.background is not None:
            b = self.background
            rows.insert(-1, ("resumed from step", str(b["resumed_from_step"])))
            if "pact_duty_cycle" in b:
                pauses = ", ".join(f"{b[f'pact_pauses_{k}']} {k}" for k in ("thermal", "power", "battery"))
                rows.insert(-1, ("pacing", f"{pauses} pauses, duty cycle {b['pact_duty_cycle']:.0%}"))
            if "pact_checkpoint_mib" in b:
                rows.insert(-1, ("checkpoint size", f"{b['pact_checkpoint_mib']:.2f} MiB ({b['checkpoints']})"))
        rows += self._example()
        width = max(len(k) for k, _ in rows)
        return "\n".join(["PACT fine-tune summary"] + [f"  {k:<{width}}  {v}" for k, v in rows])


def _card_value(value):
    """Long plans and lists shown by their size on the model card (the full values are in pact_config.json)."""
    if isinstance(value, dict) and len(value) > 4:
        kinds = {v: list(value.values()).count(v) for v in sorted(set(value.values()))}
        return ", ".join(f"{n} {kind}" for kind, n in kinds.items()) + " (see pact_config.json)"
    if isinstance(value, list) and len(value) > 4:
        return f"{len(value)} modules (see pact_config.json)"
    return value


def write_card(adapter_dir: Path, model: str | None, pact_config, args, summary: FinetuneSummary) -> None:
    """README.md in the adapter folder: base model, PACT settings and the measured metrics (Hub model card)."""
    base, note = (DEFAULT_MODEL_HUB_ID, DEFAULT_MODEL_NOTE) if model is None else (model, None)
    settings = {
        "LoRA rank (r)": pact_config.r,
        "lora_alpha": pact_config.lora_alpha,
        "target_modules": "all-linear",
        **{f"PactConfig.{k}": _card_value(v) for k, v in pact_config.pact_dict().items()},
        "frozen NVFP4 linears": summary.frozen_linears,
        "NVFP4 base rounding": (
            f"GPTQ on the training items ({summary.rounded_linears} linears; codes in {BASE_FILE})"
            if summary.rounded_linears
            else "nearest"
        ),
        "learning rate": args.learning_rate,
        "epochs": args.num_train_epochs,
        "max steps": args.max_steps,
        "batch size": args.per_device_train_batch_size,
        "seed": args.seed,
    }
    if summary.background is not None:
        settings["background mode"] = "on (thermal pacing, atomic checkpoints, resume)"
        settings["thermal limit (C)"] = args.pact_thermal_limit_c or "sensor default (40 skin / 85 CPU)"
    if summary.data_format == "labelled":
        before, after, name = summary.accuracy_before, summary.accuracy_after, "accuracy"
    else:
        before, after, name = summary.loss_before, summary.loss_after, "loss per token"
    metrics = {
        f"held-out {name} before": round(before, 4),
        f"held-out {name} after": round(after, 4),
        "data format": summary.data_format,
        "final training loss": round(summary.final_loss, 4),
        "training items / held-out items": f"{summary.train_items} / {summary.heldout_items}",
        "steps": summary.steps,
        "steps per second": round(summary.steps_per_second, 3),
        "peak memory (RSS, GiB)": round(summary.peak_rss_gib, 3),
    }
    for key, value in (summary.background or {}).items():
        if key.startswith("pact_"):
            metrics[key] = value
    write_model_card(adapter_dir, base, settings, metrics, base_model_note=note)
