"""This process's pages, as Linux counts them: which are resident (/proc/self/pagemap), and handing clean ones back.

Used by weight streaming (`optimum_pact.memory.streaming`) and by `FrozenLinear.from_linear`, which hands back the
pages of the weight it quantized: transformers maps a checkpoint whose dtype matches the model's (e.g. SmolLM2's
fp32 safetensors in an fp32 model) and its parameters are views of that file mapping, so the pages quantization
read stay resident (RssFile) for as long as any other parameter (the embedding) keeps the mapping alive.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys

import torch

PAGE = mmap.PAGESIZE
PRESENT, FILE_OR_SHARED = 1 << 63, 1 << 61  # /proc/self/pagemap flag bits (Documentation/admin-guide/mm/pagemap)

_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
if _LIBC is not None:
    _LIBC.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    _LIBC.madvise.restype = ctypes.c_int


def pages_available() -> bool:
    """Whether madvise and /proc/self/pagemap are there (Linux)."""
    return _LIBC is not None and os.path.exists("/proc/self/pagemap")


def byte_range(t: torch.Tensor) -> tuple[int, int]:
    """[start, end) addresses of the bytes `t` views (any strides)."""
    if t.numel() == 0:
        return t.data_ptr(), t.data_ptr()
    span = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    return t.data_ptr(), t.data_ptr() + span * t.element_size()


def page_range(start: int, end: int) -> tuple[int, int]:
    """[start, end) rounded out to whole pages."""
    return start & ~(PAGE - 1), (end + PAGE - 1) & ~(PAGE - 1)


def page_flags(start: int, end: int) -> torch.Tensor:
    """The /proc/self/pagemap entry (int64) of every page of [start, end), rounded out to pages."""
    lo, hi = page_range(start, end)
    if hi == lo:
        return torch.empty(0, dtype=torch.int64)
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(lo // PAGE * 8)
        return torch.frombuffer(bytearray(f.read((hi - lo) // PAGE * 8)), dtype=torch.int64)


def resident_bytes(start: int, end: int) -> int:
    """Bytes of [start, end) resident in this process (present bits of /proc/self/pagemap)."""
    return int((page_flags(start, end) < 0).sum()) * PAGE  # bit 63, the sign bit: present


def madvise(start: int, end: int, advice: int, what: str) -> None:
    """madvise the pages of [start, end) (rounded out to pages); `what` names the memory in the error."""
    lo, hi = page_range(start, end)
    if _LIBC.madvise(lo, hi - lo, advice) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"madvise({advice}) on {what} failed: {os.strerror(err)}")


def release_clean_pages(t: torch.Tensor) -> int:
    """Hand back the resident pages of `t` (rounded out to pages) when every one of them is a clean file page.

    A page of a file mapping that nobody wrote is dropped from this process only: the next read maps the same bytes
    again from the page cache (or the file). Anything else (anonymous memory, a page written since it was mapped)
    would lose its content, so then nothing is released. Returns the bytes released (0 off Linux).
    """
    if not pages_available() or t.device.type != "cpu":
        return 0
    start, end = byte_range(t)
    flags = page_flags(start, end)
    present = flags < 0
    if not bool(present.any()) or not bool(((flags & FILE_OR_SHARED) != 0)[present].all()):
        return 0
    madvise(start, end, mmap.MADV_DONTNEED, "a file-backed weight")
    return int(present.sum()) * PAGE
