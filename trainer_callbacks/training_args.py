"""PactTrainingArguments: the Trainer's arguments plus PACT's options, as ordinary dataclass fields."""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers import TrainingArguments


@dataclass
class PactTrainingArguments(TrainingArguments):
    """`TrainingArguments` plus PACT options (all prefixed `pact_`); parse them with `HfArgumentParser` as usual."""

    pact_num_threads: int | None = field(
        default=None,
        metadata={"help": "CPU threads torch uses while training (torch.set_num_threads); None keeps the default."},
    )
    pact_report_resources: bool = field(
        default=True,
        metadata={"help": "Log the process's peak resident memory and the training throughput with the metrics."},
    )

    def __post_init__(self):
        super().__post_init__()
        if self.pact_num_threads is not None and (
            isinstance(self.pact_num_threads, bool)
            or not isinstance(self.pact_num_threads, int)
            or self.pact_num_threads < 1
        ):
            raise ValueError(
                f"pact_num_threads={self.pact_num_threads!r} must be a positive integer (or None for torch's default)."
            )
