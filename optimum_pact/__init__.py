"""optimum-pact: on-device LoRA fine-tuning with an NVFP4 data-flow base (the hardware-backend package).

The core (`nvfp4`, `dataflow`, `backends`) needs only torch; `optimum_pact.quantizer` registers the
transformers quantizer, and `pact` (`optimum_pact.cli`) runs the main job.
"""

from .dataflow import FrozenLinear
from .nvfp4 import NVFP4Tensor, quantize

__version__ = "0.1.0"

__all__ = ["FrozenLinear", "NVFP4Tensor", "__version__", "quantize"]
