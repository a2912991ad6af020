"""optimum-pact: on-device LoRA fine-tuning with an NVFP4 data-flow base (the hardware-backend package).

The library below `optimum_pact.commands` needs torch and transformers only; `optimum_pact.commands` is the
application (the `pact` CLI and the main job), the one part that assembles a run from peft, `peft_ext` and
`trainer_callbacks`.

`PactQuantizationConfig` loads on first use (`from optimum_pact import PactQuantizationConfig`, or importing
`optimum_pact.quantizer`), and that registers the `pact` quantization method with transformers. It is not imported
with the package: `transformers.quantizers` imports every quantization library installed (torchao, which logs
warnings as it loads), and a run that loads no model (`pact --help`) should neither wait for nor hear from them.
"""

from .backends import get_backend
from .dataflow import FrozenLinear
from .fusion import fuse_cpu_ops
from .memory import HeapTrimmer, MemorySavers, pin_mmap_threshold, trim_heap
from .nvfp4 import NVFP4Tensor, quantize

__version__ = "0.1.0"

__all__ = [
    "FrozenLinear",
    "HeapTrimmer",
    "MemorySavers",
    "NVFP4Tensor",
    "PactQuantizationConfig",
    "__version__",
    "fuse_cpu_ops",
    "get_backend",
    "pin_mmap_threshold",
    "quantize",
    "trim_heap",
]


def __getattr__(name: str):
    if name == "PactQuantizationConfig":
        from .quantizer import PactQuantizationConfig  # registers quant_method "pact" with transformers

        return PactQuantizationConfig
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
