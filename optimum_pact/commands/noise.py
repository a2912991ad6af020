"""The third-party lines the `pact` command keeps off the terminal: a few known messages, nothing else.

With every extra installed, these print before anything of ours, and none is about the user's run:

- transformers imports torchao whenever it loads a model (`transformers.quantizers` imports every quantization
  library it finds), and torchao logs that its prebuilt kernels for another Python or GPU did not load and that
  triton (GPU kernels) is missing, then has torch log that two of its enums use a deprecated registration;
- peft imports bitsandbytes whenever it is imported, and bitsandbytes logs that an optional CPU kernel is missing;
- peft's `PeftModel` reads transformers' deprecated `is_gradient_checkpointing` (a FutureWarning).

We cannot stop them from here, so `main()` calls `quiet_third_party()` before it imports any of them: it drops
exactly these messages, by logger and message (or warning category, message and module). The library never calls
it, and every other warning, ours or a library's, still shows.
"""

from __future__ import annotations

import logging
import re
import warnings

# (logger, the start of the message): logged as torchao / bitsandbytes import, about kernels a run never uses
KNOWN_LOG_MESSAGES = (
    ("torchao", r"Failed to load \S*torchao[/\\]_C\w*\.\S*: "),
    ("torchao.kernel.intmm", r"Warning: Detected no triton, on systems without Triton certain kernels "),
    ("torch.utils._pytree", r"<enum '(KernelPreference|ScaleCalculationMode)'> is an Enum subclass and is now "),
    ("bitsandbytes.backends.cpu.ops", r"Failed to load CPU gemm_4bit_forward from kernels-community: "),
)
# (category, the start of the message, the module that warns): raised by upstream code calling upstream code
KNOWN_WARNINGS = ((FutureWarning, r"`is_gradient_checkpointing` is deprecated", r"transformers\.modeling_utils"),)


class KnownMessageFilter(logging.Filter):
    """Drops a logger's records whose message starts with `pattern`."""

    def __init__(self, pattern: str):
        super().__init__()
        self.pattern = re.compile(pattern)

    def filter(self, record: logging.LogRecord) -> bool:
        return self.pattern.match(record.getMessage()) is None


def quiet_third_party() -> None:
    """Drop the known third-party messages above, for this process (idempotent). For the `pact` command only."""
    for name, pattern in KNOWN_LOG_MESSAGES:
        logger = logging.getLogger(name)
        if not any(isinstance(f, KnownMessageFilter) and f.pattern.pattern == pattern for f in logger.filters):
            logger.addFilter(KnownMessageFilter(pattern))
    for category, message, module in KNOWN_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)


__all__ = ["KNOWN_LOG_MESSAGES", "KNOWN_WARNINGS", "quiet_third_party"]
