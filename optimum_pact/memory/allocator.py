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
mapping, page faults and zeroed pages for every tensor above it, every time: on bf16-native CPUs, where the step's
products are fast, a 4 MiB pin made peft's own SmolLM2 step 1.2-1.4x slower (benchmarks/bench_train_step.py,
lora_pinned against lora). `trim_heap` (`malloc_trim(0)`) instead hands the arenas' free pages back once: the next
step faults in what it touches again, and the freed activations no longer pile up. Trimming after every step costs
those faults every step (the main job in one pair of runs: 50.7 s against 42.7 s untrimmed); `HeapTrimmer` trims
after the first step and then only when the resident set has grown past what that step left resident, so a step
that reuses the heap's holes costs nothing. PactTrainer runs one (`pact_trim_heap`) and pins nothing unless asked
(`pact_mmap_threshold`).
"""

from __future__ import annotations

import ctypes
import logging
import os

logger = logging.getLogger(__name__)
_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096

M_MMAP_THRESHOLD = -3  # malloc.h
DEFAULT_MMAP_THRESHOLD = 4 * 2**20
MAX_MMAP_THRESHOLD = 32 * 1024 * 1024  # glibc's ceiling on 64-bit (HEAP_MAX_SIZE / 2); mallopt refuses more
_pinned: int | None = None  # what pin_mmap_threshold set in this process


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
            f"e.g. {DEFAULT_MMAP_THRESHOLD} (4 MiB)."
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
    global _pinned
    _pinned = nbytes
    logger.info("optimum_pact: glibc mmap threshold pinned at %d bytes", nbytes)
    return True


def pinned_mmap_threshold() -> int | None:
    """The mmap threshold pinned in this process (by `pin_mmap_threshold`, or MALLOC_MMAP_THRESHOLD_ in the
    environment, whose value is returned as given), None while glibc's own raising policy runs, and None for an
    environment value that is not a whole number (what glibc makes of it is glibc's; `pin_mmap_threshold` leaves it
    in place either way). Never raises: `pact finetune` asks after training, before the adapter is saved."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        try:
            return int(os.environ["MALLOC_MMAP_THRESHOLD_"] or 0)
        except ValueError:
            return None
    return _pinned


def trim_heap() -> bool:
    """Hand the free memory of glibc's heap arenas back to the operating system (`malloc_trim(0)`): the pages of a
    training step's freed activations stop counting as resident until the next step touches them again. True where
    anything was released; False where nothing was, or where the C library is not glibc."""
    libc = _glibc()
    return bool(libc is not None and libc.malloc_trim(0))


def resident_bytes() -> int | None:
    """This process's resident set now (VmRSS, from /proc/self/statm), None where /proc has no statm."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * _PAGE_SIZE
    except (OSError, IndexError, ValueError):
        return None


class HeapTrimmer:
    """`trim_heap` when it pays: call it after each training step. The first call trims and keeps the resident set
    the step left (its activations freed but still resident: the working set the next step reuses); a later call
    trims only once the resident set exceeds that by more than `slack` (default: 1/32 of it, at least 64 MiB), i.e.
    when freed memory piles up instead of being reused. Where /proc cannot be read it trims every call."""

    MIN_SLACK = 64 * 2**20

    def __init__(self, slack: int | None = None):
        self.slack, self.baseline, self.trims = slack, None, 0

    def __call__(self) -> bool:
        rss = resident_bytes()
        if self.baseline is None or rss is None:
            self.baseline = rss
        elif rss <= self.baseline + (self.slack if self.slack is not None else max(self.MIN_SLACK, rss // 32)):
            return False
        self.trims += 1
        return trim_heap()
