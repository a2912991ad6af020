"""PactTrainer: the Trainer with PACT's options wired in through public hooks (callbacks) only."""

from __future__ import annotations

import logging

import torch
from transformers import Trainer, TrainerCallback

from optimum_pact.dataflow import FrozenLinear

from .resources import ResourceReportCallback
from .training_args import PactTrainingArguments

logger = logging.getLogger(__name__)


class _ThreadsCallback(TrainerCallback):
    def __init__(self, num_threads: int):
        self.num_threads = num_threads

    def on_train_begin(self, args, state, control, **kwargs):
        torch.set_num_threads(self.num_threads)


class PactTrainer(Trainer):
    """`Trainer` that reads `PactTrainingArguments` and adds the matching callbacks.

    It trains any model; a model without a `FrozenLinear` (no `PactConfig` applied) trains as plain LoRA and
    gets a warning, since none of PACT's frozen-weight products run then.
    """

    def __init__(self, model=None, args: PactTrainingArguments | None = None, *pargs, **kwargs):
        super().__init__(model, args, *pargs, **kwargs)
        if model is not None and not any(isinstance(m, FrozenLinear) for m in model.modules()):
            logger.warning("PactTrainer: the model has no FrozenLinear; apply PactConfig with get_peft_model first.")
        self.resources = None
        if isinstance(self.args, PactTrainingArguments):
            if self.args.pact_num_threads is not None:
                self.add_callback(_ThreadsCallback(self.args.pact_num_threads))
            if self.args.pact_report_resources:
                self.resources = ResourceReportCallback()
                self.add_callback(self.resources)

    def log(self, logs: dict[str, float], *args, **kwargs) -> None:
        """Adds `peak_rss_gib` and `train_steps_per_second_measured` to every log (Trainer's documented hook)."""
        if self.resources is not None and self.resources.started:
            logs = {**logs, **self.resources.metrics(self.state)}
        super().log(logs, *args, **kwargs)
