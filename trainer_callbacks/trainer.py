"""PactTrainer: the Trainer with PACT's options wired in through public hooks (callbacks) only."""

from __future__ import annotations

import inspect
import logging
from pathlib import Path

import torch
from torch.utils.data import DataLoader
from transformers import (
    AttentionMaskInterface,
    DataCollatorWithFlattening,
    Trainer,
    TrainerCallback,
    default_data_collator,
)
from transformers.trainer_callback import ProgressCallback

from optimum_pact.attention import use_short_attention
from optimum_pact.dataflow import FrozenLinear
from optimum_pact.errors import OptionError
from optimum_pact.fusion import fuse_cpu_ops
from optimum_pact.memory import HeapTrimmer, MemorySavers, OffloadError, check_subset_k, pin_mmap_threshold
from peft_ext.conversion import apply_pact_options

from .resources import ResourceReportCallback
from .resumable import ResumableExecutionCallback
from .thermal import ThermalPacingCallback
from .training_args import MODEL_PREFIX, PactTrainingArguments

logger = logging.getLogger(__name__)


class _ThreadsCallback(TrainerCallback):
    def __init__(self, num_threads: int):
        self.num_threads = num_threads

    def on_train_begin(self, args, state, control, **kwargs):
        torch.set_num_threads(self.num_threads)


class _HeapTrimCallback(TrainerCallback):
    """pact_trim_heap: glibc's free heap back to the operating system after the first optimizer step, then whenever
    the resident set has grown past what that step left (`HeapTrimmer`)."""

    def on_train_begin(self, args, state, control, **kwargs):
        self.trimmer = HeapTrimmer()

    def on_step_end(self, args, state, control, **kwargs):
        self.trimmer()


def attention_implementation(model) -> str | None:
    """The attention implementation `model` runs (`config._attn_implementation`), None if it has no config."""
    return getattr(getattr(model, "config", None), "_attn_implementation", None)


def supports_padding_free(model) -> bool:
    """Whether `model`'s attention keeps the examples of a padding-free row apart. transformers 5 does so wherever it
    builds the attention mask (masking_utils, every implementation in `AttentionMaskInterface`: eager, sdpa,
    flex_attention; flash_attention_* run varlen): position ids that restart start a new example."""
    return attention_implementation(model) in AttentionMaskInterface().valid_keys()


class PaddingFreeCollator(DataCollatorWithFlattening):
    """transformers' `DataCollatorWithFlattening` (one row, position ids restarting per example, each example's first
    label -100) that refuses rows with padding in them: their pad tokens would join the row as text."""

    def __call__(
        self, features: list[dict], return_tensors: str | None = None, separator_id: int | None = None
    ) -> dict:
        for feature in features:
            if 0 in feature.get("attention_mask", ()):
                raise ValueError(
                    "pact_padding_free=True: a training row has attention_mask zeros (it is padded); padding-free "
                    "batches join rows as they are, so pad tokens would be read as text. Tokenize without padding "
                    "or set pact_padding_free=False."
                )
        return super().__call__(features, return_tensors, separator_id)


class PactTrainer(Trainer):
    """`Trainer` that reads `PactTrainingArguments` and adds the matching callbacks.

    It trains any model; a model without a `FrozenLinear` (no `PactConfig` applied) trains as plain LoRA and
    gets a warning, since none of PACT's frozen-weight products run then. With pact_padding_free each training batch
    is one row (`PaddingFreeCollator`); evaluation and the calibration batch use the given data collator.
    """

    def __init__(self, model=None, args: PactTrainingArguments | None = None, *pargs, **kwargs):
        if isinstance(args, PactTrainingArguments) and model is not None:
            model = self._apply_model_options(model, args, pargs, kwargs)
        super().__init__(model, args, *pargs, **kwargs)
        if model is not None and not any(isinstance(m, FrozenLinear) for m in model.modules()):
            logger.warning("PactTrainer: the model has no FrozenLinear; apply PactConfig with get_peft_model first.")
        self.resources = None
        self.memory_savers: MemorySavers | None = None  # set while train() runs with pact_memory_saver
        self.mapped_weights: dict | None = None  # after train() with memory savers: `_mapped_weights_metrics()`
        self.fused_cpu_ops = None  # optimum_pact.fusion.FusedCpuOps, set by train() with pact_fuse_cpu_ops
        self.padding_free_collator: PaddingFreeCollator | None = None  # training batches, with pact_padding_free
        self._pact_parameter_count: int | None = None  # the model's, for `floating_point_ops`; reset by train()
        if isinstance(self.args, PactTrainingArguments):
            if self.args.pact_padding_free:
                self.padding_free_collator = self._padding_free_collator()
            if self.args.pact_num_threads is not None:
                self.add_callback(_ThreadsCallback(self.args.pact_num_threads))
            if self.args.pact_trim_heap:
                self.add_callback(_HeapTrimCallback())
            if self.args.pact_report_resources:
                self.resources = ResourceReportCallback()
                self.add_callback(self.resources)
            if self.args.pacing_enabled:
                self.add_callback(
                    ThermalPacingCallback(
                        limit_c=self.args.pact_thermal_limit_c,
                        hysteresis_c=self.args.pact_thermal_hysteresis_c,
                        zones=self.args.thermal_zone_patterns,
                        duty_cycle=self.args.pact_duty_cycle,
                        only_while_charging=self.args.pact_only_while_charging,
                        min_battery=self.args.pact_min_battery,
                        sysfs_root=self.args.pact_sysfs_root,
                        poll_seconds=self.args.pact_pacing_poll_seconds,
                    )
                )
            if self.args.resumable_enabled:  # after the pacer: a signal during a pause is seen at that step's end
                self.add_callback(ResumableExecutionCallback(save_every_minutes=self.args.pact_save_minutes))

    @staticmethod
    def _apply_model_options(model, args: PactTrainingArguments, pargs: tuple, kwargs: dict):
        """The model-side `pact_` options applied to `model` (peft_ext.conversion), before the Trainer sees it."""
        given, options = args.pact_options_set(), args.pact_options()
        batch = None
        if options.uses_calibration:  # a calibration batch: the first of the training data
            bound = inspect.signature(Trainer.__init__).bind_partial(None, model, args, *pargs, **kwargs).arguments
            data, collate = bound.get("train_dataset"), bound.get("data_collator") or default_data_collator
            if data is not None:
                batch = collate([data[i] for i in range(min(len(data), args.per_device_train_batch_size))])
            elif options.needs_calibration:  # rank_by="auto" ranks by NVFP4 error without one
                raise ValueError(
                    f"{MODEL_PREFIX}{options.calibration_option} needs a train_dataset to calibrate on (its first "
                    "batch): pass train_dataset, or calibrate the model yourself (PactConfig.with_calibration)."
                )
        convert = bool(given) or args.pact_nvfp4_base
        return apply_pact_options(model, options, given, convert, MODEL_PREFIX, batch)

    def _padding_free_collator(self) -> PaddingFreeCollator:
        used = attention_implementation(self.model)
        if not supports_padding_free(self.model):
            raise OptionError(
                "pact_padding_free",
                f"pact_padding_free=True: this model's attention implementation {used!r} does not keep packed "
                f"examples apart (transformers does for {', '.join(AttentionMaskInterface().valid_keys())}); load "
                "the model with attn_implementation='sdpa' (or call model.set_attn_implementation('sdpa')), or set "
                "pact_padding_free=False.",
            )
        given = type(self.data_collator).__name__
        logger.info(
            "PactTrainer: padding-free training batches (DataCollatorWithFlattening, %s attention) instead of %s, "
            "which evaluation keeps",
            used,
            given,
        )
        return PaddingFreeCollator()

    def get_train_dataloader(self) -> DataLoader:
        """`Trainer.get_train_dataloader` (its documented hook); with pact_padding_free it batches with the
        padding-free collator, while evaluation keeps the given one."""
        if self.padding_free_collator is None:
            return super().get_train_dataloader()
        given, self.data_collator = self.data_collator, self.padding_free_collator
        try:
            return super().get_train_dataloader()
        finally:
            self.data_collator = given

    def floating_point_ops(self, inputs: dict) -> int:
        """`Trainer.floating_point_ops` (what `total_flos` adds up), the same number, with the model's parameter count
        taken once per train() call: transformers counts it on every step, walking every module twice (4.7 ms of the
        main job's ~470 ms step), and a step adds or removes no parameter."""
        main_input = getattr(self.model, "main_input_name", "input_ids")
        if main_input not in inputs or not hasattr(self.model, "num_parameters"):
            return super().floating_point_ops(inputs)
        if self._pact_parameter_count is None:
            self._pact_parameter_count = self.model.num_parameters(exclude_embeddings=True)
        return 6 * inputs[main_input].numel() * self._pact_parameter_count

    def callback(self, kind: type) -> TrainerCallback | None:
        """The registered callback of type `kind`, or None (looked up each time: a resume may replace it)."""
        return next((cb for cb in self.callback_handler.callbacks if isinstance(cb, kind)), None)

    @property
    def pacer(self) -> ThermalPacingCallback | None:
        return self.callback(ThermalPacingCallback)

    @property
    def resumable(self) -> ResumableExecutionCallback | None:
        return self.callback(ResumableExecutionCallback)

    def find_checkpoint(self) -> str | None:
        """The newest verified checkpoint of this run (None: start fresh); needs pact_resumable."""
        if self.resumable is None:
            raise ValueError("find_checkpoint needs pact_resumable=True (or the ResumableExecutionCallback).")
        return self.resumable.find_checkpoint(self.args, self.model)

    def train(self, resume_from_checkpoint: str | bool | None = None, *args, **kwargs):
        """`Trainer.train`; with pact_resumable, `resume_from_checkpoint=True` takes the newest verified checkpoint
        (corrupt ones are reported and skipped) and a given path is verified first. A checkpoint from another base
        model or adapter configuration is refused with a ValueError. A checkpoint save that runs out of disk space
        is a NoSpaceError (an OSError) naming the folder and the space needed; the half-written checkpoint is removed.
        """
        if self.resumable is not None and resume_from_checkpoint is True:
            found = self.find_checkpoint()
            if found is None:
                raise ValueError(
                    f"resume_from_checkpoint=True but {self.resumable.checkpoints_dir(self.args)} holds no valid "
                    "checkpoint; pass None to start fresh."
                )
            resume_from_checkpoint = found
        elif self.resumable is not None and isinstance(resume_from_checkpoint, (str, Path)):
            self.resumable.check_checkpoint(resume_from_checkpoint, self.model)
            resume_from_checkpoint = str(resume_from_checkpoint)
        self._pact_parameter_count = None  # counted again: the model may have changed since the last train()
        if isinstance(self.args, PactTrainingArguments) and self.args.pact_mmap_threshold is not None:
            pin_mmap_threshold(self.args.pact_mmap_threshold)
        pact_args = isinstance(self.args, PactTrainingArguments)
        short_attention = pact_args and self.args.pact_short_attention and use_short_attention(self.model)
        fuse = pact_args and self.args.pact_fuse_cpu_ops
        self.fused_cpu_ops = fuse_cpu_ops(self.model) if fuse else None  # before the savers: they chunk the fused MLPs
        try:
            self.memory_savers = self._start_memory_savers()
            return super().train(resume_from_checkpoint, *args, **kwargs)
        except Exception as err:  # a checkpoint save cut short: no half-written folder, a full disk said as such
            self._close_progress_bar()  # what is said next starts a line of its own
            no_space = self.resumable.training_failed(self.args, err) if self.resumable is not None else None
            if no_space is None:
                raise
            raise no_space from err
        finally:  # also on a failed step: the forwards are restored and the offload files deleted
            if self.memory_savers is not None:
                self.mapped_weights = self._mapped_weights_metrics()
                self.memory_savers.close()
                self.memory_savers = None
            if self.fused_cpu_ops is not None:
                self.fused_cpu_ops.restore()
            if short_attention:
                self.model.set_attn_implementation("sdpa")

    def _close_progress_bar(self) -> None:
        """End the Trainer's progress bar after a failed `train` (on_train_end, which closes it, does not run then)."""
        progress = self.callback(ProgressCallback)
        if progress is not None and getattr(progress, "training_bar", None) is not None:
            progress.training_bar.close()
            progress.training_bar = None

    def _start_memory_savers(self) -> MemorySavers | None:
        args = self.args
        if not isinstance(args, PactTrainingArguments) or not args.memory_savers_enabled:
            return None
        head = self.model.get_output_embeddings()
        if args.pact_subset_k is not None and head is not None:  # fail with the Trainer option's name
            check_subset_k(args.pact_subset_k, head.weight.shape[0], "pact_subset_k", "pact_memory_saver='exact'")
        try:
            savers = MemorySavers.from_preset(self.model, args.pact_memory_saver, **args.memory_saver_options())
        except OffloadError as err:  # name the Trainer option, not the library's keyword
            raise OffloadError(
                err.errno,
                f"pact_offload_dir={args.offload_dir!r} is not writable ({err.__cause__ or err}); pass a writable "
                "folder on a disk with free space, or pact_memory_saver='none'.",
            ) from err
        where = f", offloading to {args.offload_dir}" if args.savers_checkpoint else ""
        logger.info("PactTrainer: memory savers %r on%s", args.pact_memory_saver, where)
        return savers

    def _mapped_weights_metrics(self) -> dict:
        """The memory savers' mapped frozen weights: bytes mapped and, when streamed, the most seen resident."""
        savers = self.memory_savers
        out = {"mapped_gib": round(sum(t.numel() * t.element_size() for t in savers.mapped_weights) / 2**30, 4)}
        if savers.stream is not None:
            out["mapped_resident_peak_gib"] = round(savers.stream.peak_resident_bytes / 2**30, 4)
        return out

    def log(self, logs: dict[str, float], *args, **kwargs) -> None:
        """Adds `peak_rss_gib` and `train_steps_per_second_measured` to every log (Trainer's documented hook), and
        the pacing and checkpoint figures when those callbacks are on."""
        if self.resources is not None and self.resources.started:
            logs = {**logs, **self.resources.metrics(self.state)}
        for callback in (self.pacer, self.resumable):
            if callback is not None:
                logs = {**logs, **callback.metrics()}
        if self.fused_cpu_ops is not None:
            logs = {**logs, "fused_cpu_ops_compile_s": round(self.fused_cpu_ops.compile_seconds(), 2)}
        if self.memory_savers is not None and self.memory_savers.mapped_weights:
            logs = {**logs, **self._mapped_weights_metrics()}
        super().log(logs, *args, **kwargs)
