"""optimum-pact: on-device LoRA fine-tuning with an NVFP4 data-flow base (the hardware-backend package).

The library below `optimum_pact.commands` needs torch and transformers only; `optimum_pact.commands` is the
application (the `pact` CLI and the main job), the one part that assembles a run from peft, `peft_ext` and
`trainer_callbacks`.

Every name loads on first use: importing the package imports nothing heavy. `PactQuantizationConfig` (`from
optimum_pact import PactQuantizationConfig`, or importing `optimum_pact.quantizer`) registers the `pact` quantization
method with transformers; `transformers.quantizers` imports every quantization library installed (torchao, which logs
warnings as it loads), and a run that loads no model (`pact --help`) should neither wait for nor hear from them.
"""

import importlib

__version__ = "0.1.0"

# name -> the submodule that defines it: imported on first use (PEP 562), so that `import optimum_pact` (and the
# `pact` CLI's paths that need no model, such as `--engine llama.cpp` with its GGUF cached) does not import torch
_EXPORTS = {
    "FrozenLinear": ".dataflow",
    "HeapTrimmer": ".memory",
    "MemorySavers": ".memory",
    "NVFP4Tensor": ".nvfp4",
    "PactQuantizationConfig": ".quantizer",  # registers quant_method "pact" with transformers
    "fuse_cpu_ops": ".fusion",
    "get_backend": ".backends",
    "pin_mmap_threshold": ".memory",
    "quantize": ".nvfp4",
    "trim_heap": ".memory",
}

__all__ = sorted([*_EXPORTS, "__version__"])


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
