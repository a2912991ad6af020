"""Trainer side of PACT: `PactTrainingArguments`, `PactTrainer` and their callbacks."""

from .checkpoint import CorruptCheckpointError, find_checkpoint, model_identity, read_manifest
from .lock import OutputDirLock, OutputDirLockedError
from .model_card import write_model_card
from .resources import ResourceReportCallback, peak_rss_bytes
from .resumable import ResumableExecutionCallback, TrainingInterrupted
from .thermal import ThermalPacingCallback
from .trainer import PactTrainer
from .training_args import PactTrainingArguments

__all__ = [
    "CorruptCheckpointError",
    "OutputDirLock",
    "OutputDirLockedError",
    "PactTrainer",
    "PactTrainingArguments",
    "ResourceReportCallback",
    "ResumableExecutionCallback",
    "ThermalPacingCallback",
    "TrainingInterrupted",
    "find_checkpoint",
    "model_identity",
    "peak_rss_bytes",
    "read_manifest",
    "write_model_card",
]
