"""optimum-pact: on-device LoRA fine-tuning with an NVFP4 data-flow base (the hardware-backend package).

Importing it registers the `pact` quantization method with transformers (`PactQuantizationConfig`). The library
below `optimum_pact.commands` needs torch and transformers only; `optimum_pact.commands` is the application (the
`pact` CLI and the main job), the one part that assembles a run from peft, `peft_ext` and `trainer_callbacks`.
"""

from .backends import get_backend
from .dataflow import FrozenLinear
from .fusion import fuse_cpu_ops
from .memory import MemorySavers, pin_mmap_threshold
from .nvfp4 import NVFP4Tensor, quantize
from .quantizer import PactQuantizationConfig

__version__ = "0.1.0"

__all__ = [
    "FrozenLinear",
    "MemorySavers",
    "NVFP4Tensor",
    "PactQuantizationConfig",
    "__version__",
    "fuse_cpu_ops",
    "get_backend",
    "pin_mmap_threshold",
    "quantize",
]
