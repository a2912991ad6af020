"""Disk offload of the tensors autograd saves for backward: async writes, prefetched reads, no files left behind.

`ActivationOffloader.pack` / `unpack` are a pair of `torch.autograd.graph.saved_tensors_hooks`. `pack` hands the
tensor to a writer thread and returns a handle; the tensor's memory is released as soon as its file is written.
Backward unpacks in the reverse order of the forward, so `unpack` of one tensor starts reading the one packed just
before it (prefetch): the disk read overlaps the recomputation and backward of the current block.

Files live in a private folder `pact-offload-<pid>-<random>` under `offload_dir`. A file is deleted as soon as it
has been read back. The files of a step whose backward raised are deleted when the next forward starts
(`begin_forward`), at `discard_all()` / `close()`, or at interpreter exit: they cannot wait for garbage collection,
because after an error torch's autograd engine keeps the unfinished part of the graph queued. A step whose backward
never started loses its files when its graph is dropped. Folders left by a process that was killed are removed by
the next offloader that starts in the same `offload_dir`.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from ..files import pid_alive

FOLDER_PREFIX = "pact-offload-"
MAX_PENDING_WRITES = 2  # tensors waiting for the writer thread; each holds its memory until written


class OffloadError(OSError):
    """The offload directory cannot be used (not writable, out of space, a failed read). The message says how."""


def _write_bytes(path: Path, data: memoryview) -> None:
    """Write one tensor's bytes (the only function that writes offload data; tests inject failures here)."""
    with open(path, "wb") as f:
        f.write(data)


def _read_into(path: Path, out: torch.Tensor) -> None:
    with open(path, "rb") as f:
        view = memoryview(out.numpy()).cast("B")
        if f.readinto(view) != len(view):
            raise OffloadError(errno.EIO, f"offload file {path} is shorter than the tensor it holds")


def remove_stale_folders(root: Path) -> list[Path]:
    """Delete `pact-offload-<pid>-*` folders in `root` whose process no longer runs (left by a killed run)."""
    removed = []
    for folder in root.glob(f"{FOLDER_PREFIX}*"):
        pid = folder.name[len(FOLDER_PREFIX) :].split("-", 1)[0]
        if pid.isdigit() and int(pid) != os.getpid() and not pid_alive(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


def make_offload_folder(offload_dir: str | os.PathLike | None) -> Path:
    """Create this process's private folder under `offload_dir` (default: the system temp dir), or say why not."""
    root = Path(offload_dir if offload_dir is not None else tempfile.gettempdir()).expanduser()
    try:
        root.mkdir(parents=True, exist_ok=True)
        folder = Path(tempfile.mkdtemp(prefix=f"{FOLDER_PREFIX}{os.getpid()}-", dir=root))
        probe = folder / "probe"
        probe.write_bytes(b"\0" * 4096)
        probe.unlink()
    except OSError as err:
        raise OffloadError(
            err.errno,
            f"offload_dir {str(root)!r} is not writable ({type(err).__name__}: {err.strerror or err}). Pass a "
            "writable folder on a disk with free space as offload_dir, or turn activation offload off "
            "(offload=False).",
        ) from err
    remove_stale_folders(root)
    return folder


class OffloadedTensor:
    """Handle returned by `pack`: where the bytes are, how to rebuild the tensor, and the pending I/O."""

    def __init__(self, index: int, path: Path, tensor: torch.Tensor, forward: int):
        self.index, self.path, self.forward = index, path, forward
        self.shape, self.dtype, self.device = tensor.shape, tensor.dtype, tensor.device
        self.nbytes = tensor.numel() * tensor.element_size()
        self.written: Future | None = None
        self.read: Future | None = None
        self.used = False  # unpacked once; a second unpack is an error
        self.deleted = False
        self._finalizer = weakref.finalize(self, _unlink, path)  # the file goes with the handle at the latest

    def discard(self) -> None:
        """Delete the file (idempotent)."""
        self.deleted = True
        self._finalizer()


def _unlink(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class ActivationOffloader:
    """Saved-tensor hooks that keep the packed tensors on disk between forward and backward.

    One writer and one reader thread (file I/O releases the GIL). At most `MAX_PENDING_WRITES` tensors wait for
    the writer, so the forward never holds more than that many extra copies in memory; backward holds the tensor
    being used plus the one prefetched. A write error (for example ENOSPC) is raised as `OffloadError` by the next
    `pack` or by the first `unpack` of the step, before any gradient of an offloaded block is computed; the files
    of the failed step are deleted.
    """

    def __init__(self, offload_dir: str | os.PathLike | None = None):
        self.root = Path(offload_dir if offload_dir is not None else tempfile.gettempdir()).expanduser()
        self.folder = make_offload_folder(offload_dir)
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="pact-offload-write")
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="pact-offload-read")
        self._lock = threading.Lock()
        self._handles: list[weakref.ref[OffloadedTensor]] = []  # this step's, in pack order
        self._count = 0
        self._forward = 0  # forward passes begun; handles remember theirs
        self._backward_started: set[int] = set()  # forwards whose backward unpacked something
        self._error: OffloadError | None = None
        self.bytes_written = 0
        self._closed = False
        # runs at close(), when the offloader is garbage collected, or at interpreter exit, whichever comes first
        self._remove_folder = weakref.finalize(self, shutil.rmtree, self.folder, True)

    def begin_forward(self) -> None:
        """A new forward starts: delete what is left of forwards whose backward started (it raised)."""
        for ref in self._handles:
            handle = ref()
            if handle is not None and handle.forward in self._backward_started and not handle.used:
                handle.discard()
        self._backward_started.clear()
        self._forward += 1

    def discard_all(self) -> None:
        """Delete the files of every tensor not yet read back (the step that packed them is abandoned)."""
        self._wait_writes()
        for ref in self._handles:
            handle = ref()
            if handle is not None:
                handle.discard()
        self._handles, self._error = [], None

    def live_files(self) -> list[Path]:
        return sorted(p for p in self.folder.iterdir()) if self.folder.exists() else []

    # ---- hooks ----
    def pack(self, tensor: torch.Tensor) -> OffloadedTensor:
        self._check_open()
        self._raise_pending_error()
        tensor = tensor.detach()
        if tensor.device.type != "cpu":
            tensor = tensor.to("cpu", non_blocking=False)
        tensor = tensor.contiguous()
        with self._lock:
            self._count += 1
            handle = OffloadedTensor(self._count, self.folder / f"{self._count:06d}.bin", tensor, self._forward)
        handle.written = self._writer.submit(self._write, handle, tensor)
        del tensor  # the writer thread holds the only reference until the bytes are on disk
        self._handles = [r for r in self._handles if (h := r()) is not None and not h.used]
        self._handles.append(weakref.ref(handle))
        pending = [h for r in self._handles if (h := r()) is not None and not h.written.done()]
        if len(pending) > MAX_PENDING_WRITES:
            pending[0].written.exception()  # back-pressure: wait for the oldest write
            self._raise_pending_error()
        return handle

    def unpack(self, handle: OffloadedTensor) -> torch.Tensor:
        if handle.used:
            raise RuntimeError(
                "An offloaded activation was already used and deleted: running backward twice over the same graph "
                "(retain_graph=True) is not supported with activation offload."
            )
        self._backward_started.add(handle.forward)
        if handle.read is None:  # the first unpack of a step: every write of the step must have succeeded
            self._wait_writes()
            self._raise_pending_error()
            self._start_read(handle)
        try:
            tensor = handle.read.result()
        except OSError as err:
            self.discard_all()
            if isinstance(err, OffloadError):
                raise
            raise OffloadError(
                err.errno, f"could not read offloaded activations back from {handle.path}: {err}"
            ) from err
        handle.used = True
        self._prefetch_before(handle)
        return tensor.to(handle.device) if handle.device.type != "cpu" else tensor

    # ---- threads ----
    def _write(self, handle: OffloadedTensor, tensor: torch.Tensor) -> None:
        if self._error is not None or handle.deleted:
            return
        try:
            _write_bytes(handle.path, memoryview(tensor.view(-1).view(torch.uint8).numpy()))
            self.bytes_written += handle.nbytes
        except OSError as err:
            _unlink(handle.path)
            if err.errno == errno.ENOSPC:
                message = (
                    f"offload_dir {str(self.root)!r} ran out of space while writing "
                    f"{handle.nbytes / 2**20:.1f} MiB of activations (ENOSPC). Free space there, pass an offload_dir "
                    "on a larger disk, or turn activation offload off (offload=False). The step was abandoned and "
                    "its offload files deleted; parameters and optimizer state are unchanged."
                )
            else:
                message = f"writing offloaded activations to {handle.path} failed: {err}"
            self._error = OffloadError(err.errno, message)

    def _start_read(self, handle: OffloadedTensor) -> None:
        # The destination is allocated here, on the caller's thread, so that memory accounting (a dispatch mode,
        # thread-local) sees it; the reader thread only fills it.
        out = torch.empty(handle.shape, dtype=handle.dtype)
        handle.read = self._reader.submit(self._read, handle, out)

    def _read(self, handle: OffloadedTensor, out: torch.Tensor) -> torch.Tensor:
        handle.written.result()
        if self._error is not None:
            raise self._error
        _read_into(handle.path, out.view(-1).view(torch.uint8))
        handle.discard()  # the bytes are in memory now: the file goes
        return out

    def _prefetch_before(self, handle: OffloadedTensor) -> None:
        """Start reading the tensor packed just before `handle`: backward needs it next."""
        for ref in reversed(self._handles):
            other = ref()
            if other is not None and other.index < handle.index and not other.used:
                if other.read is None:
                    self._start_read(other)
                return

    def _wait_writes(self) -> None:
        for ref in self._handles:
            handle = ref()
            if handle is not None and handle.written is not None:
                handle.written.exception()

    def _raise_pending_error(self) -> None:
        if self._error is not None:
            error = self._error
            self.discard_all()
            raise error

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("This ActivationOffloader is closed; create a new one (enable_memory_savers).")

    def close(self) -> None:
        """Stop the threads and delete the folder with everything in it."""
        if self._closed:
            return
        self._closed = True
        self._writer.shutdown(wait=True)
        self._reader.shutdown(wait=True)
        for ref in self._handles:
            handle = ref()
            if handle is not None:
                handle.discard()
        self._handles = []
        self._remove_folder()

    def __repr__(self) -> str:
        return f"ActivationOffloader(folder={str(self.folder)!r})"
