"""Folders written aside and renamed into place (`optimum_pact.files.aside_folder`): one a killed process left (a
SIGKILL mid-export leaves gigabytes) is removed by the next write beside it; one whose process still runs is not."""

import os
import subprocess
import sys

from optimum_pact.files import aside_folder


def test_a_dead_writers_folder_is_removed_and_a_live_ones_kept(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)  # exited: nothing has that pid now (a reuse would only keep its folder)
    left = tmp_path / f".me.gguf-model-{dead_pid}-abc123"
    (left / "model").mkdir(parents=True)
    (left / "model" / "weights.safetensors").write_bytes(b"x" * 1024)
    running = tmp_path / f".me.gguf-model-{os.getppid()}-def456"  # the process that started this one
    running.mkdir()
    other = tmp_path / f".other.gguf-model-{dead_pid}-ghi789"  # another output's: not this write's to judge
    other.mkdir()
    new = aside_folder(tmp_path, "me.gguf-model")
    assert new.is_dir() and new.name.startswith(f".me.gguf-model-{os.getpid()}-")
    assert not left.exists() and running.is_dir() and other.is_dir()
    assert aside_folder(tmp_path, "me.gguf-model") != new and new.is_dir()  # this process's own: kept
