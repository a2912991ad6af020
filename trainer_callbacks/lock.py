"""OutputDirLock: one training run per output directory; a lock left by a dead process is taken over.

The lock is `<output_dir>/.pact.lock`, held with `fcntl.flock` for the life of the process: the kernel releases it
when the process dies, even on kill -9, so a leftover file from a dead run is simply taken over (and reported).
The file records the holder's pid, host and start time for the error message. Without fcntl (Windows) the file is
created exclusively and a leftover one is taken over when its pid no longer runs.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from pathlib import Path

from optimum_pact.files import pid_alive

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None

logger = logging.getLogger(__name__)

LOCK_NAME = ".pact.lock"


class OutputDirLockedError(RuntimeError):
    """Another live process is training into the same output directory."""


class OutputDirLock:
    """Context manager holding `<output_dir>/.pact.lock`; raises OutputDirLockedError if a live process has it."""

    def __init__(self, output_dir: str | os.PathLike):
        self.output_dir = Path(output_dir)
        self.path = self.output_dir / LOCK_NAME
        self._fd: int | None = None
        self.recovered_from: dict | None = None  # the stale holder taken over, if any

    def _holder(self) -> dict:
        try:
            return json.loads(self.path.read_text() or "{}")
        except (OSError, ValueError):
            return {}

    def _locked_error(self, holder: dict) -> OutputDirLockedError:
        pid = holder.get("pid", "?")
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder["started"])) if "started" in holder else "?"
        return OutputDirLockedError(
            f"output directory {self.output_dir} is locked by a running training process (pid {pid} on "
            f"{holder.get('host', '?')}, since {since}). Wait for it to finish, stop it (kill {pid}; it saves a "
            f"checkpoint and exits), or use another --output."
        )

    def acquire(self) -> OutputDirLock:
        self.output_dir.mkdir(parents=True, exist_ok=True)
        if fcntl is None:
            return self._acquire_exclusive()
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                raise self._locked_error(self._holder()) from None
            try:  # the holder may have unlinked the file between our open and flock: lock the current one
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        self._fd = fd
        self._take_over(self._holder())
        return self

    def _acquire_exclusive(self) -> OutputDirLock:
        for _ in range(2):
            try:
                self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
                self._take_over({})
                return self
            except FileExistsError:
                holder = self._holder()
                if holder.get("pid") and pid_alive(int(holder["pid"])):
                    raise self._locked_error(holder) from None
                self.recovered_from = holder
                self.path.unlink(missing_ok=True)
        raise self._locked_error(self._holder())

    def _take_over(self, previous: dict) -> None:
        if previous.get("pid") and previous.get("pid") != os.getpid():
            self.recovered_from = self.recovered_from or previous
        if self.recovered_from:
            logger.warning(
                f"{self.path}: took over a stale lock left by process {self.recovered_from.get('pid')} "
                f"on {self.recovered_from.get('host', '?')}, which is no longer running."
            )
        record = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}
        os.ftruncate(self._fd, 0)
        os.lseek(self._fd, 0, os.SEEK_SET)
        os.write(self._fd, (json.dumps(record) + "\n").encode())
        os.fsync(self._fd)

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            self.path.unlink(missing_ok=True)
        finally:
            os.close(self._fd)  # closing drops the flock
            self._fd = None

    def __enter__(self) -> OutputDirLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
