"""Keep glibc's malloc from hoarding a training step's freed tensors.

glibc serves an allocation above its mmap threshold (128 KiB at start) with its own mapping and unmaps it on free,
but each time it frees such a chunk it raises the threshold to that chunk's size, up to 32 MiB. After a training
step's first activation-sized frees, every tensor of 1-32 MiB comes from the heap arenas instead, and a freed one
stays resident there, in holes that later requests of other sizes do not fill. Measured on SmolLM2-135M, batch
4 x 512, fp32, two steps (mallinfo2, an ad-hoc probe on a 2-core AVX2 AMD EPYC): the arenas held 8.5 GB with 8.2 GB
of it free under PACT (peak RSS 9.9 GiB, still growing) and 5.5 GB with 5.3 GB free under peft LoRA (7.4 GiB); with
the threshold pinned, 0.25 GB arenas and 4.2 / 4.5 GiB peaks. That is the whole step, not PACT's dequantized weights
(which the torch backend writes into a reused buffer anyway).

`pin_mmap_threshold` sets the threshold once (`mallopt(M_MMAP_THRESHOLD)`), which also turns the raising off, so
large tensors go back to the operating system when freed. It is process-wide and stays set. The price is a fresh
mapping, page faults and zeroed pages for every tensor above it, so the default is 4 MiB, not glibc's 128 KiB: the
main job (short batches, many 0.1-4 MiB tensors) took 134.6 s at 128 KiB, 89.0 s at 4 MiB and 73.4 s at 32 MiB
(peak RSS 1.52 / 1.75 / 1.73 GiB; single runs). Larger steps favour lower values: PACT's SmolLM2 step at batch
4 x 512 took 21.8 s at 128 KiB (peak RSS 4.59 GiB) and 22.0 s at 4 MiB (5.13 GiB), against peft LoRA unpinned at
19-20 s and 7.7-7.9 GiB (benchmarks/bench_train_step.py, 3 sessions each, 2-core AVX2 AMD EPYC).
"""

from __future__ import annotations

import ctypes
import logging
import os

logger = logging.getLogger(__name__)

M_MMAP_THRESHOLD = -3  # malloc.h
DEFAULT_MMAP_THRESHOLD = 4 * 2**20
MAX_MMAP_THRESHOLD = 32 * 1024 * 1024  # glibc's ceiling on 64-bit (HEAP_MAX_SIZE / 2); mallopt refuses more


def _glibc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 - present in glibc only
        return libc
    except (OSError, AttributeError):
        return None


def check_mmap_threshold(nbytes: object, option: str = "nbytes") -> None:
    """Raise a ValueError naming `option` unless `nbytes` is an int in [0, 32 MiB]."""
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or not 0 <= nbytes <= MAX_MMAP_THRESHOLD:
        raise ValueError(
            f"{option}={nbytes!r} is invalid; pass a byte count from 0 to {MAX_MMAP_THRESHOLD} (glibc's ceiling), "
            f"e.g. {DEFAULT_MMAP_THRESHOLD} (4 MiB, the default)."
        )


def pin_mmap_threshold(nbytes: int = DEFAULT_MMAP_THRESHOLD) -> bool:
    """Pin glibc's mmap threshold at `nbytes`: allocations above it are mapped and given back to the operating system
    when freed, for the rest of the process. True where set; False where the C library is not glibc, or where
    the environment already sets MALLOC_MMAP_THRESHOLD_ (that setting wins)."""
    check_mmap_threshold(nbytes)
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    libc = _glibc()
    if libc is None:
        return False
    if libc.mallopt(M_MMAP_THRESHOLD, nbytes) != 1:
        raise RuntimeError(f"glibc's mallopt(M_MMAP_THRESHOLD, {nbytes}) failed")
    logger.info("optimum_pact: glibc mmap threshold pinned at %d bytes", nbytes)
    return True
