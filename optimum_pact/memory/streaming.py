"""Stream the memory-mapped frozen weights: only the weights being multiplied stay resident.

`map_frozen_weights` puts the frozen weights in a file mapping, but a step touches every one of them (forward,
recomputation, input gradient), so without more they all become resident (RssFile, and so VmHWM) and stay so.
`WeightStream` hands each touched range back to the kernel as soon as its use is over:

- after each `FrozenLinear` product the mapping is released (`madvise(MADV_DONTNEED)`) and the kernel is asked to
  read ahead (`MADV_WILLNEED`) the next layer's packed weight, in the order the pass runs (forward: the next layer;
  input gradient: the one before);
- contiguous slices of the output-head / embedding table (the full-vocabulary loss, the nearest-token index) are
  released after every `window_bytes` read (`touch`); rows gathered from all over the table (the embedding lookup,
  the subset softmax, the index's query rows) are read from the file with pread (`gather`), never through the mapping;
- anything else mapped is released with the rest by `release_all()` (MemorySavers calls it before each step).

So the process holds at most one layer's packed weight and `window_bytes` of the table at a time (plus the page-cache
folios around them, see `release_all`); `peak_resident_bytes` is what the kernel showed, sampled. Exact: the
mapping is private, file-backed and never written, so a released page reads back the same bytes from the page cache
(or the disk, if the kernel dropped it): losses and gradients are bit for bit those of the same step without
streaming (tests/test_streaming.py).

Releasing is only ever done on ranges checked to lie in the weights file's mapping (`/proc/self/maps`, by inode):
`MADV_DONTNEED` on anonymous memory would zero it. Before each product the file's size is checked (`fstat` on the
descriptor kept open): a file cut short under a running job raises `WeightsFileError` instead of the SIGBUS the next
page fault would raise. Linux only (madvise, /proc); elsewhere MemorySavers maps without streaming.
"""

from __future__ import annotations

import mmap
import os

import torch
from torch import nn

from ..dataflow import FrozenLinear
from ..dataflow.linear import PACKED_NAMES
from ..nvfp4.kernels import pread_rows
from ..pages import PAGE, byte_range, madvise, pages_available, resident_bytes
from .weights import WeightsFile, WeightsFileError

DEFAULT_WINDOW_BYTES = 16 * 2**20  # output-head / embedding rows touched between two releases


def streaming_available() -> bool:
    return pages_available() and os.path.exists("/proc/self/maps")


def file_mappings(device: int, inode: int) -> list[tuple[int, int, int]]:
    """(start, end, file offset) of this process's mappings of the file `inode` on `device` (st_dev; from
    /proc/self/maps)."""
    out, dev = [], f"{os.major(device):02x}:{os.minor(device):02x}"
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            if len(fields) >= 5 and int(fields[4]) == inode and fields[3] == dev:
                lo, hi = fields[0].split("-")
                out.append((int(lo, 16), int(hi, 16), int(fields[2], 16)))
    return out


def _madvise(lo: int, hi: int, advice: int, path: str) -> None:
    """madvise the pages of [lo, hi) (rounded out to pages) of the mapping of the weights file `path`."""
    madvise(lo, hi, advice, f"the mapping of {path}")


def mapping_resident_bytes(weights_file: WeightsFile) -> int:
    """Bytes of `weights_file` resident in this process now (every mapping of it)."""
    return sum(resident_bytes(lo, hi) for lo, hi, _ in file_mappings(weights_file.device, weights_file.inode))


def release_mapping(weights_file: WeightsFile) -> None:
    """Drop every resident page of this process's mappings of `weights_file` (they read back on use)."""
    for lo, hi, _ in file_mappings(weights_file.device, weights_file.inode):
        _madvise(lo, hi, mmap.MADV_DONTNEED, weights_file.path)


class _LayerStream:
    """One FrozenLinear's packed tensors in the stream; `FrozenLinear` calls `before` / `after` around a product."""

    def __init__(self, stream: WeightStream, ranges: list[tuple[int, int]]):
        self.stream, self.ranges = stream, ranges
        self.nbytes = sum(hi - lo for lo, hi in ranges)
        self.next: _LayerStream | None = None
        self.previous: _LayerStream | None = None

    def before(self, kind: str) -> None:
        self.stream.weights_file.check()

    def after(self, kind: str) -> None:
        self.stream.release_all()
        ahead = self.next if kind == "forward" else self.previous
        if ahead is not None:
            for lo, hi in ahead.ranges:
                self.stream.advise(lo, hi, mmap.MADV_WILLNEED)


class WeightStream:
    """Release the mapped frozen weights of `model` as soon as each use is over (see the module docstring).

    Args:
        model: the model `map_frozen_weights` mapped (a transformers or peft model).
        weights_file: the `WeightsFile` it returned.
        window_bytes: table rows touched between two releases of the table.
        sample_every: read the mapping's resident bytes (/proc/self/pagemap, ~0.3 ms for 170 MB) before every
            this many releases, for `peak_resident_bytes`: the largest resident share of the weights file seen.
    Call `close()` to take the hooks off (the weights stay mapped).
    """

    def __init__(
        self,
        model: nn.Module,
        weights_file: WeightsFile,
        window_bytes: int = DEFAULT_WINDOW_BYTES,
        sample_every: int = 8,
    ):
        if not streaming_available():
            raise RuntimeError("Weight streaming needs Linux (madvise and /proc/self/maps).")
        if isinstance(window_bytes, bool) or not isinstance(window_bytes, int) or window_bytes < PAGE:
            raise ValueError(f"WeightStream window_bytes={window_bytes!r} must be an integer >= {PAGE} (one page).")
        self.weights_file, self.window_bytes = weights_file, window_bytes
        found = file_mappings(weights_file.device, weights_file.inode)
        self.mappings = [(lo, hi) for lo, hi, _ in found]
        self._offsets = [offset for _, _, offset in found]
        if not self.mappings:
            raise RuntimeError(f"The weights file {weights_file.path} is not mapped in this process.")
        self.releases = self.peak_resident_bytes = 0
        self.sample_every = max(1, int(sample_every))
        self._touched = 0
        self._layers: list[tuple[FrozenLinear, _LayerStream]] = []
        previous = None
        for module in model.modules():
            if not isinstance(module, FrozenLinear):
                continue
            tensors = [getattr(module, name) for name in PACKED_NAMES if hasattr(module, name)]
            ranges = [byte_range(t) for t in tensors]
            if not all(self._inside(lo, hi) for lo, hi in ranges):
                continue  # not mapped (e.g. on another device): left alone
            layer = _LayerStream(self, ranges)
            layer.previous, module.stream = previous, layer
            if previous is not None:
                previous.next = layer
            previous = layer
            self._layers.append((module, layer))
        self._embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        if not self._readable(self._embedding):
            self._embedding = None
        elif "forward" in vars(self._embedding):
            raise ValueError(f"{type(self._embedding).__name__}.forward is already replaced on this instance.")
        else:  # the batch's rows read from the file: a lookup through the mapping would map the table's folios
            self._embedding.forward = self._lookup

    @property
    def layers(self) -> int:
        return len(self._layers)

    def _mapping_index(self, lo: int, hi: int) -> int | None:
        """Which of the weights file's mappings holds [lo, hi) whole (None: none does)."""
        return next((i for i, (start, end) in enumerate(self.mappings) if start <= lo and hi <= end), None)

    def _inside(self, lo: int, hi: int) -> bool:
        return self._mapping_index(lo, hi) is not None

    def advise(self, lo: int, hi: int, advice: int) -> None:
        """madvise the pages of [lo, hi), which must lie in the weights file's mapping."""
        if not self._inside(lo, hi):
            raise ValueError(f"[{lo:#x}, {hi:#x}) is not in the mapping of {self.weights_file.path}; not released.")
        _madvise(lo, hi, advice, self.weights_file.path)

    def touch(self, t: torch.Tensor, nbytes: int) -> None:
        """`nbytes` of `t` (an output-head / embedding table) were just read: release once `window_bytes` were
        read since the last release."""
        self.weights_file.check()
        self._touched += nbytes
        if self._touched >= self.window_bytes:
            self.release_all()

    def release_all(self) -> None:
        """Drop every resident page of the weights file (safe at any time: they read back on use). The whole
        mapping, not the range just used: a page fault maps the page cache's whole folio around the page (up to
        2 MiB), neighbours included. It costs ~50 us for a 1 GiB mapping (AMD EPYC, Linux 6.18)."""
        if self.releases % self.sample_every == 0:
            self.peak_resident_bytes = max(self.peak_resident_bytes, self.resident_bytes())
        for lo, hi in self.mappings:
            self.advise(lo, hi, mmap.MADV_DONTNEED)
        self.releases += 1
        self._touched = 0

    def resident_bytes(self) -> int:
        """The weights file's bytes resident in this process now (from /proc/self/pagemap)."""
        return sum(resident_bytes(lo, hi) for lo, hi in self.mappings)

    def _readable(self, embedding) -> bool:
        return (
            type(embedding) is nn.Embedding
            and embedding.max_norm is None
            and embedding.weight.is_contiguous()
            and self._inside(*byte_range(embedding.weight))
        )

    def _lookup(self, input_ids: torch.Tensor) -> torch.Tensor:
        """`nn.Embedding.forward` (frozen weight, no max_norm) with the rows read from the weights file."""
        ids, inverse = input_ids.reshape(-1).unique(return_inverse=True)
        return self.gather(self._embedding.weight, ids)[inverse].view(*input_ids.shape, -1)

    def gather(self, table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """`table[ids]` for a mapped 2-D contiguous `table` and 1-D `ids`, read from the weights file with pread, never
        through the mapping: a page fault maps the page-cache folio around it (up to 2 MiB), so rows gathered from
        all over a table would map most of it. Other tensors: `table[ids]`."""
        lo, hi = byte_range(table)
        index = self._mapping_index(lo, hi)
        if index is None or not table.is_contiguous() or table.dim() != 2:
            return table[ids]
        self.weights_file.check()
        out = torch.empty(len(ids), table.shape[1], dtype=table.dtype)
        base = self._offsets[index] + lo - self.mappings[index][0]
        if pread_rows(self.weights_file.fd, base, ids, out) != len(ids):
            self.weights_file.check()  # names a truncated file
            raise OSError(f"Reading rows of the weights file {self.weights_file.path} failed.")
        return out

    def close(self) -> None:
        if self._embedding is not None:
            vars(self._embedding).pop("forward", None)
            self._embedding = None
        for module, layer in self._layers:
            if module.stream is layer:
                module.stream = None
        self._layers = []


__all__ = [
    "DEFAULT_WINDOW_BYTES",
    "WeightStream",
    "WeightsFileError",
    "mapping_resident_bytes",
    "release_mapping",
    "resident_bytes",
    "streaming_available",
]
