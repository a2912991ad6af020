"""PactTrainingArguments: the Trainer's arguments plus PACT's options, as ordinary dataclass fields."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from transformers import TrainingArguments

from optimum_pact.errors import OptionError
from optimum_pact.memory import (
    MEMORY_SAVER_PRESETS,
    check_mmap_threshold,
    check_subset_k,
    streaming_available,
)
from peft_ext.options import PactOptions, check_pact_options, derived_options

from .thermal import check_pacing_options

MEMORY_SAVERS = tuple(MEMORY_SAVER_PRESETS)  # none, logits, exact, full
MODEL_PREFIX = "pact_"
# PactOptions' fields (backend, AQLoRA, precision budget) as `pact_<name>`: declared once, in PactOptions
PactModelArguments = derived_options("PactModelArguments", prefix=MODEL_PREFIX)


def check_memory_saver_options(
    memory_saver: str,
    subset_k: int | None = None,
    cache_mib: float = 0.0,
    mlp_chunk_tokens: int | None = 512,
    names: dict[str, str] | None = None,
) -> None:
    """The memory-saver options' checks; `names` maps each argument to its option name (default: the argument
    names). Raises `OptionError` naming the option."""
    name = {k: k for k in ("memory_saver", "subset_k", "cache_mib", "mlp_chunk_tokens")}
    name.update(names or {})
    if memory_saver not in MEMORY_SAVERS:
        raise OptionError(
            name["memory_saver"], f"{name['memory_saver']}={memory_saver!r} is not one of {', '.join(MEMORY_SAVERS)}."
        )
    if subset_k is not None:
        check_subset_k(subset_k, name=name["subset_k"])
        if memory_saver != "full":
            raise OptionError(
                name["subset_k"],
                f"{name['subset_k']}={subset_k} is used by {name['memory_saver']}='full' only (it is "
                f"{memory_saver!r}); set {name['memory_saver']}='full' or leave {name['subset_k']} unset.",
            )
    if isinstance(cache_mib, bool) or not isinstance(cache_mib, (int, float)) or not cache_mib >= 0:
        raise OptionError(name["cache_mib"], f"{name['cache_mib']}={cache_mib!r} must be a number of MiB >= 0.")
    chunk = mlp_chunk_tokens
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
        raise OptionError(
            name["mlp_chunk_tokens"],
            f"{name['mlp_chunk_tokens']}={chunk!r} must be a positive integer (or None: no chunks).",
        )


@dataclass
class PactTrainingArguments(TrainingArguments, PactModelArguments):
    """`TrainingArguments` plus PACT options (all prefixed `pact_`); parse them with `HfArgumentParser` as usual.

    The model-side options are `PactOptions`' fields with the prefix (`pact_backend`, `pact_protect_fraction`, ...):
    `PactTrainer` applies them to a bare or plain-LoRA model, and checks that a `PactConfig` model agrees.
    """

    ddp_broadcast_buffers: bool | None = field(  # TrainingArguments' field, PACT's default
        default=False,
        metadata={
            "help": "DistributedDataParallel's broadcast_buffers. PACT's default is False: the packed NVFP4 weights "
            "are buffers, identical on every process, and gloo (multi-process CPU) cannot broadcast float8."
        },
    )

    pact_nvfp4_base: bool = field(
        default=False,
        metadata={
            "help": "Put the frozen linears of a model not built with PactConfig (bare, or with plain peft LoRA) on "
            "an NVFP4 base behind pact_backend before training. Setting any other model-side pact_ option does too."
        },
    )
    pact_num_threads: int | None = field(
        default=None,
        metadata={"help": "CPU threads torch uses while training (torch.set_num_threads); None keeps the default."},
    )
    pact_fuse_cpu_ops: bool = field(
        default=False,
        metadata={
            "help": "Compile each RMSNorm and gated MLP activation (torch.compile, once per model class and shape "
            "bucket) so the step's element-wise CPU work runs fused; the compile time is logged. "
            "optimum_pact.fuse_cpu_ops(model) does the same without PactTrainer."
        },
    )
    pact_short_attention: bool = field(
        default=True,
        metadata={
            "help": "While training, a model loaded with sdpa attention runs optimum_pact.attention's 'pact_sdpa': "
            "on the CPU, a layer's attention over at most 192 keys (and 2**21 scores) is fp32 matmuls + softmax "
            "instead of sdpa's flash kernel, whose CPU backward costs 2-3x as much at short lengths; longer "
            "sequences, inference and other devices stay on sdpa. sdpa is restored after training."
        },
    )
    pact_trim_heap: bool = field(
        default=True,
        metadata={
            "help": "Hand glibc's free heap back to the operating system (malloc_trim) after the first optimizer "
            "step, then whenever the resident set has grown past what that step left: glibc keeps a step's freed "
            "activations resident in its arenas, and they pile up over steps. optimum_pact.HeapTrimmer does the "
            "same without PactTrainer (benchmarks/bench_main_job.py, bench_train_step.py measure it)."
        },
    )
    pact_mmap_threshold: int | None = field(
        default=None,
        metadata={
            "help": "Pin glibc's mmap threshold (bytes) when training starts, so every freed tensor above it goes "
            "back to the operating system at once. Off by default: each such tensor then costs a fresh mapping and "
            "page faults, and at 4 MiB the step took 1.1-1.4x as long as unpinned on bf16-native CPUs; "
            "pact_trim_heap keeps the peak as low for less. Process-wide; MALLOC_MMAP_THRESHOLD_ in the "
            "environment wins. optimum_pact.pin_mmap_threshold() does the same without PactTrainer."
        },
    )
    pact_report_resources: bool = field(
        default=True,
        metadata={"help": "Log the process's peak resident memory and the training throughput with the metrics."},
    )
    pact_padding_free: bool = field(
        default=False,
        metadata={
            "help": "Train on padding-free batches (transformers' DataCollatorWithFlattening): a batch's examples "
            "in one row, position ids restarting at each, attention kept inside each example, so no pad token is "
            "computed and the loss and gradients are the padded batch's. Needs an attention implementation that "
            "reads packed position ids (eager, sdpa, flex_attention, flash_attention_*) and use_cache=False; "
            "evaluation and the calibration batch keep the given data collator."
        },
    )
    # ---- pacing (ThermalPacingCallback); setting any option below turns it on ----
    pact_thermal_pacing: bool = field(
        default=False,
        metadata={
            "help": "Pause between steps while the device is too hot (and, if set, off the charger or low on "
            "battery). Setting any other pacing option turns this on too."
        },
    )
    pact_thermal_limit_c: float | None = field(
        default=None,
        metadata={
            "help": "Pause when the hottest selected thermal zone reaches this many degrees Celsius. None: 40 on a "
            "phone's skin sensor, 85 on CPU sensors."
        },
    )
    pact_thermal_hysteresis_c: float = field(
        default=2.0, metadata={"help": "After a thermal pause, resume once this many degrees below the limit."}
    )
    pact_thermal_zones: str | None = field(
        default=None,
        metadata={
            "help": "Comma-separated globs of thermal zone types that count (e.g. 'skin-therm,cpu*'); needs "
            "pact_thermal_limit_c. None: the skin zones if any, else the CPU zones."
        },
    )
    pact_duty_cycle: float | None = field(
        default=None,
        metadata={"help": "Train at most this fraction of the time, resting after each step (0.5: rest = step)."},
    )
    pact_only_while_charging: bool = field(
        default=False, metadata={"help": "Pause while the device is not on external power."}
    )
    pact_min_battery: int | None = field(
        default=None, metadata={"help": "Pause while the battery is below this percentage."}
    )
    pact_sysfs_root: str = field(
        default="/sys", metadata={"help": "Where the thermal and power-supply sensors are read (class/thermal, ...)."}
    )
    pact_pacing_poll_seconds: float = field(default=2.0, metadata={"help": "How often sensors are read while paused."})
    # ---- resumable execution (ResumableExecutionCallback) ----
    pact_resumable: bool = field(
        default=False,
        metadata={
            "help": "Commit checkpoints atomically with a checksum manifest into <output_dir>/checkpoints, keep "
            "save_total_limit of them, save and stop on SIGTERM/SIGINT, and resume_from_checkpoint=True picks the "
            "newest one that verifies. Checkpoints follow save_strategy/save_steps (and pact_save_minutes)."
        },
    )
    pact_save_minutes: float | None = field(
        default=None,
        metadata={"help": "Also checkpoint once this many minutes passed since the last one (sets pact_resumable)."},
    )

    # ---- memory savers (optimum_pact.memory.MemorySavers), on for the duration of train() ----
    pact_memory_saver: str = field(
        default="none",
        metadata={
            "help": "'logits': the output head run only at labelled positions, so a prompt's tokens never get "
            "[vocab] logits (same loss and gradients as 'none'; less time and memory wherever prompts are "
            "unlabelled). 'exact': checkpoint every decoder block with its input offloaded to disk, MLP recomputed in "
            "chunks, frozen weights memory-mapped, output head run only at labelled positions (same loss and "
            "gradients as 'none'). 'full': 'exact' + the loss as a softmax over the target and its "
            "pact_subset_k - 1 nearest tokens and the batch's other targets (an approximation). 'none': off.",
            "choices": list(MEMORY_SAVERS),
        },
    )
    pact_offload_dir: str | None = field(
        default=None,
        metadata={"help": "Folder for offloaded activations and mapped weights; default <output_dir>/pact-offload."},
    )
    pact_subset_k: int | None = field(
        default=None,
        metadata={
            "help": "pact_memory_saver='full': nearest tokens in each position's softmax (target + k - 1); None: 1000."
        },
    )
    pact_stream_weights: bool = field(
        default=True,
        metadata={
            "help": "Memory savers: hand each mapped frozen weight's pages back to the kernel as soon as its product "
            "is done, so one layer (and a window of output-head rows) is resident at a time; the same losses and "
            "gradients. Linux (madvise); elsewhere the weights are mapped without streaming."
        },
    )
    pact_activation_cache_mib: float = field(
        default=0.0,
        metadata={"help": "RAM per step for attention outputs kept instead of recomputed (memory savers on)."},
    )
    pact_mlp_chunk_tokens: int | None = field(
        default=512,
        metadata={"help": "Memory savers: recompute each MLP in chunks of this many tokens (None: in one piece)."},
    )

    def __post_init__(self):
        super().__post_init__()
        check_pact_options(self, MODEL_PREFIX)
        self._check_memory_saver_options()
        if self.pact_num_threads is not None and (
            isinstance(self.pact_num_threads, bool)
            or not isinstance(self.pact_num_threads, int)
            or self.pact_num_threads < 1
        ):
            raise OptionError(
                "pact_num_threads",
                f"pact_num_threads={self.pact_num_threads!r} must be a positive integer (None: torch's default).",
            )
        if self.pact_mmap_threshold is not None:
            try:
                check_mmap_threshold(self.pact_mmap_threshold, "pact_mmap_threshold")
            except ValueError as err:
                raise OptionError("pact_mmap_threshold", f"{err} None leaves glibc's own policy.") from None
        if not isinstance(self.pact_trim_heap, bool):
            raise OptionError("pact_trim_heap", f"pact_trim_heap={self.pact_trim_heap!r} must be True or False.")
        if not isinstance(self.pact_short_attention, bool):
            raise OptionError(
                "pact_short_attention", f"pact_short_attention={self.pact_short_attention!r} must be True or False."
            )
        if not isinstance(self.pact_fuse_cpu_ops, bool):
            raise OptionError(
                "pact_fuse_cpu_ops", f"pact_fuse_cpu_ops={self.pact_fuse_cpu_ops!r} must be True or False."
            )
        self._check_padding_free()
        check_pacing_options(
            self.pact_thermal_limit_c,
            self.pact_thermal_hysteresis_c,
            self.pact_duty_cycle,
            self.pact_min_battery,
            self.pact_pacing_poll_seconds,
            names={
                "limit_c": "pact_thermal_limit_c",
                "hysteresis_c": "pact_thermal_hysteresis_c",
                "duty_cycle": "pact_duty_cycle",
                "min_battery": "pact_min_battery",
                "poll_seconds": "pact_pacing_poll_seconds",
            },
        )
        if self.pact_thermal_zones is not None and not self.thermal_zone_patterns:
            raise OptionError(
                "pact_thermal_zones",
                f"pact_thermal_zones={self.pact_thermal_zones!r} names no zone; give comma-separated globs of "
                "thermal zone types (e.g. 'skin-therm,cpu*') or leave it unset for the defaults.",
            )
        if self.pact_thermal_zones is not None and self.pact_thermal_limit_c is None:
            raise OptionError(
                "pact_thermal_zones",
                f"pact_thermal_zones={self.pact_thermal_zones!r} needs pact_thermal_limit_c (degrees Celsius) "
                "for those sensors.",
            )
        if self.pact_save_minutes is not None and (
            isinstance(self.pact_save_minutes, bool)
            or not isinstance(self.pact_save_minutes, (int, float))
            or not self.pact_save_minutes > 0
        ):
            raise OptionError(
                "pact_save_minutes",
                f"pact_save_minutes={self.pact_save_minutes!r} must be a positive number of minutes.",
            )
        if self.resumable_enabled and self.load_best_model_at_end:
            raise ValueError(
                "load_best_model_at_end=True does not work with pact_resumable=True (checkpoints are moved into "
                "<output_dir>/checkpoints when committed); turn one of them off."
            )
        if self.resumable_enabled and self.save_total_limit is not None and self.save_total_limit < 1:
            raise OptionError(
                "save_total_limit",
                f"save_total_limit={self.save_total_limit!r} must be at least 1 with pact_resumable.",
            )

    def _check_padding_free(self) -> None:
        if not isinstance(self.pact_padding_free, bool):
            raise OptionError(
                "pact_padding_free", f"pact_padding_free={self.pact_padding_free!r} must be True or False."
            )
        if self.pact_padding_free and self.use_cache:  # transformers finds packed examples only without a KV cache
            raise OptionError(
                "pact_padding_free",
                "pact_padding_free=True needs use_cache=False: with a KV cache transformers does not read the packed "
                "position ids, so attention would cross from one example into the next; drop use_cache=True or set "
                "pact_padding_free=False.",
            )
        if self.pact_padding_free and self.neftune_noise_alpha is not None:
            raise OptionError(
                "pact_padding_free",
                f"pact_padding_free=True does not go with neftune_noise_alpha={self.neftune_noise_alpha!r}: NEFTune "
                "scales its noise by 1/sqrt(row length), so a batch joined into one row would get about "
                "1/sqrt(batch size) of the padded batch's noise; set pact_padding_free=False or drop "
                "neftune_noise_alpha.",
            )

    def _check_memory_saver_options(self) -> None:
        check_memory_saver_options(
            self.pact_memory_saver,
            self.pact_subset_k,
            self.pact_activation_cache_mib,
            self.pact_mlp_chunk_tokens,
            names={
                "memory_saver": "pact_memory_saver",
                "subset_k": "pact_subset_k",
                "cache_mib": "pact_activation_cache_mib",
                "mlp_chunk_tokens": "pact_mlp_chunk_tokens",
            },
        )
        if self.pact_offload_dir is not None and not self.savers_checkpoint:
            raise OptionError(
                "pact_offload_dir",
                f"pact_offload_dir={self.pact_offload_dir!r} is used by pact_memory_saver 'exact' or 'full' only; "
                "set pact_memory_saver or drop pact_offload_dir.",
            )
        if self.savers_checkpoint and self.activation_checkpointing:  # gradient_checkpointing is its alias
            raise OptionError(
                "pact_memory_saver",
                f"pact_memory_saver={self.pact_memory_saver!r} checkpoints the decoder blocks itself; set "
                "activation_checkpointing=False (or pact_memory_saver='none' to use transformers' checkpointing).",
            )

    def pact_options(self) -> PactOptions:
        """The model-side options as a `PactOptions` (what `PactConfig` takes)."""
        return PactOptions(**{name: getattr(self, MODEL_PREFIX + name) for name in PactOptions.names()})

    def pact_options_set(self) -> dict:
        """The model-side options given a value other than their default, by their `PactOptions` name."""
        defaults = PactOptions()
        return {
            name: getattr(self, MODEL_PREFIX + name)
            for name in PactOptions.names()
            if getattr(self, MODEL_PREFIX + name) != getattr(defaults, name)
        }

    @property
    def memory_savers_enabled(self) -> bool:
        return self.pact_memory_saver != "none"

    @property
    def savers_checkpoint(self) -> bool:
        """Whether the memory saver checkpoints the blocks itself (and offloads, maps the weights): 'exact', 'full'."""
        return MEMORY_SAVER_PRESETS[self.pact_memory_saver]["checkpoint"]

    @property
    def offload_dir(self) -> str:
        """Where the memory savers put offloaded activations and mapped weights."""
        return self.pact_offload_dir or os.path.join(self.output_dir, "pact-offload")

    def memory_saver_options(self) -> dict:
        """Keyword arguments for `MemorySavers.from_preset(model, self.pact_memory_saver, **options)`."""
        options = {
            "offload_dir": self.offload_dir,
            "cache_mib": float(self.pact_activation_cache_mib),
            "mlp_chunk_tokens": self.pact_mlp_chunk_tokens,
            "stream_weights": bool(self.pact_stream_weights) and streaming_available() and self.savers_checkpoint,
        }
        if self.pact_memory_saver == "full" and self.pact_subset_k is not None:
            options["subset_k"] = self.pact_subset_k
        return options

    @property
    def pacing_enabled(self) -> bool:
        return bool(
            self.pact_thermal_pacing
            or self.pact_thermal_limit_c is not None
            or self.pact_thermal_zones is not None
            or self.pact_duty_cycle is not None
            or self.pact_only_while_charging
            or self.pact_min_battery is not None
        )

    @property
    def resumable_enabled(self) -> bool:
        return bool(self.pact_resumable or self.pact_save_minutes is not None)

    @property
    def thermal_zone_patterns(self) -> list[str] | None:
        if self.pact_thermal_zones is None:
            return None
        return [p.strip() for p in self.pact_thermal_zones.split(",") if p.strip()]
