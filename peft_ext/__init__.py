"""PEFT side of PACT: `PactConfig` (a drop-in for `LoraConfig`), its model-side options `PactOptions`, the LoRA
layer over `FrozenLinear`, and AQLoRA (ranking, protection, the speed setting's backward stop)."""

from .config import PACT_CONFIG_NAME, PactConfig
from .layer import PactLoraLinear, dispatch_pact
from .options import PactOptions

__all__ = ["PACT_CONFIG_NAME", "PactConfig", "PactLoraLinear", "PactOptions", "dispatch_pact"]
