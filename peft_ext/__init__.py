"""PEFT side of PACT: `PactConfig`, a drop-in for `LoraConfig`, and the LoRA layer over `FrozenLinear`."""

from .config import PACT_CONFIG_NAME, PactConfig
from .layer import PactLoraLinear, dispatch_pact

__all__ = ["PACT_CONFIG_NAME", "PactConfig", "PactLoraLinear", "dispatch_pact"]
