"""Trainer side of PACT: `PactTrainingArguments`, `PactTrainer` and their callbacks."""

from .resources import ResourceReportCallback, peak_rss_bytes
from .trainer import PactTrainer
from .training_args import PactTrainingArguments

__all__ = ["PactTrainer", "PactTrainingArguments", "ResourceReportCallback", "peak_rss_bytes"]
