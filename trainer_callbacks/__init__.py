"""Trainer side of PACT: `PactTrainingArguments`, `PactTrainer` and the callbacks they add, which also work on the
stock `Trainer`. Helpers for applications (the output-folder lock, the model card, checkpoint manifests) live in
their modules (`trainer_callbacks.lock`, `.model_card`, `.checkpoint`)."""

from .checkpoint import CorruptCheckpointError
from .resources import ResourceReportCallback
from .resumable import ResumableExecutionCallback, TrainingInterrupted
from .thermal import ThermalPacingCallback
from .trainer import PactTrainer
from .training_args import PactTrainingArguments

__all__ = [
    "CorruptCheckpointError",
    "PactTrainer",
    "PactTrainingArguments",
    "ResourceReportCallback",
    "ResumableExecutionCallback",
    "ThermalPacingCallback",
    "TrainingInterrupted",
]
