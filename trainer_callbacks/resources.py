"""Peak memory and throughput, reported with the Trainer's metrics."""

from __future__ import annotations

import os
import resource
import sys
import time

from transformers import TrainerCallback


def peak_rss_bytes() -> int:
    """The process's resident-memory high-water mark (VmHWM on Linux)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB elsewhere


def process_seconds() -> float | None:
    """Seconds since this process started (Linux: /proc), imports included; None where it cannot be read."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime, after the (comm)
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return uptime - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


class ResourceReportCallback(TrainerCallback):
    """Measures peak memory and throughput since training began; `PactTrainer.log` adds them to every log."""

    def __init__(self):
        self._start = None
        self._start_step = 0

    def on_train_begin(self, args, state, control, **kwargs):
        self._start, self._start_step = time.perf_counter(), state.global_step

    @property
    def started(self) -> bool:
        return self._start is not None

    def metrics(self, state) -> dict:
        elapsed = time.perf_counter() - self._start if self._start else 0.0
        steps = state.global_step - self._start_step
        return {
            "peak_rss_gib": round(peak_rss_bytes() / 2**30, 3),
            "train_steps_per_second_measured": round(steps / elapsed, 4) if elapsed > 0 else 0.0,
        }
