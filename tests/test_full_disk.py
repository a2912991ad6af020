"""A disk that fills up under `pact finetune`: one line naming the folder and the space needed, exit code 2, no
half-written checkpoint or adapter left behind, and the same command, run again once there is space, continues.

The disk is a small tmpfs (mounting one needs root, as in CI); where mounting is refused, peft's safetensors writer
is made to fail with ENOSPC instead, as a full disk would.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
from pathlib import Path

import pytest

from optimum_pact.commands.cli import main
from optimum_pact.files import free_bytes
from trainer_callbacks.checkpoint import folder_bytes, list_checkpoints, read_manifest


class SmallDisk:
    """A folder on a file system that `fill` leaves with about `leave` free bytes and `free` empties again."""

    def __init__(self, root: Path, monkeypatch: pytest.MonkeyPatch):
        self.root, self.ballast = root, root / "ballast"
        root.mkdir()
        self.mounted, self.full = self._mount(root), False
        if not self.mounted:
            import peft.peft_model

            write = peft.peft_model.safe_save_file  # the adapter's weights: in a checkpoint and at the end

            def save_file(tensors, filename, *args, **kwargs):
                if self.full and Path(filename).is_relative_to(root):
                    Path(filename).write_bytes(b"\0" * 100)  # what a full disk leaves: part of the file
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(filename))
                return write(tensors, filename, *args, **kwargs)

            monkeypatch.setattr(peft.peft_model, "safe_save_file", save_file)

    @staticmethod
    def _mount(root: Path) -> bool:
        if os.name != "posix" or os.geteuid() != 0:
            return False
        try:
            command = ["mount", "-t", "tmpfs", "-o", "size=32m", "tmpfs", str(root)]
            return subprocess.run(command, capture_output=True).returncode == 0
        except OSError:  # no mount command
            return False

    def fill(self, leave: int) -> None:
        self.full = True
        if self.mounted:
            with open(self.ballast, "wb") as f:
                f.write(b"\0" * max(0, free_bytes(self.root) - leave))

    def free(self) -> None:
        self.full = False
        self.ballast.unlink(missing_ok=True)

    def close(self) -> None:
        if self.mounted:
            subprocess.run(["umount", str(self.root)], check=True)


@pytest.fixture
def disk(tmp_path, monkeypatch):
    small = SmallDisk(tmp_path / "disk", monkeypatch)
    yield small
    small.close()


@pytest.fixture
def cli(small_model, tmp_path_factory) -> list[str]:
    sysfs = tmp_path_factory.mktemp("sys")  # no sensors: pacing warns and runs on
    return ["finetune", "--model", str(small_model), "--dtype", "float32", "--batch-size", "2", "--epochs", "10",
            "--sysfs-root", str(sysfs)]  # fmt: skip


def _error_line(capsys) -> str:
    """stderr's one `pact finetune: error:` line, checked to be its last and to follow no traceback."""
    err = capsys.readouterr().err
    assert "Traceback" not in err, err[-3000:]
    lines = [line for line in err.splitlines() if "error" in line.lower()]
    assert len(lines) == 1 and lines[0].startswith("pact finetune: error: "), err[-3000:]
    assert err.rstrip().splitlines()[-1] == lines[0], err[-3000:]
    return lines[0]


def _mib(line: str, before: str) -> float:
    return float(line.split(before)[1].split(" MiB")[0].split()[-1])


def test_a_full_disk_while_checkpointing_is_one_line_and_the_same_command_continues(cli, disk, capsys):
    out = disk.root / "out"
    run = [*cli, "--background", "--save-steps", "2", "--output", str(out)]
    assert main([*run, "--max-steps", "2"]) == 0
    checkpoints, trainer = out / "trainer" / "checkpoints", out / "trainer"
    assert [c.name for c in list_checkpoints(checkpoints)] == ["checkpoint-2"]
    adapter = (out / "adapter" / "adapter_model.safetensors").read_bytes()

    disk.fill(leave=folder_bytes(checkpoints / "checkpoint-2") // 2)
    capsys.readouterr()
    assert main([*run, "--max-steps", "4"]) == 2
    line = _error_line(capsys)
    assert line.startswith(f"pact finetune: error: no space left in {trainer} while saving checkpoint-4 (needs about ")
    assert line.endswith("MiB free); free space and run the same command again to continue"), line
    assert not disk.mounted or _mib(line, "needs about") > _mib(line, ", "), line  # a tmpfs: really full
    assert not list(trainer.glob("checkpoint-*")) and not list(out.rglob("*.tmp"))  # the half-written one is gone
    assert [c.name for c in list_checkpoints(checkpoints)] == ["checkpoint-2"]
    assert read_manifest(checkpoints / "checkpoint-2")["global_step"] == 2  # checksums and contents verify
    assert (out / "adapter" / "adapter_model.safetensors").read_bytes() == adapter

    disk.free()
    assert main([*run, "--max-steps", "4"]) == 0
    assert f"resuming from {checkpoints / 'checkpoint-2'}" in capsys.readouterr().err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["background"]["resumed_from_step"] == 2
    assert [c.name for c in list_checkpoints(checkpoints)] == ["checkpoint-2", "checkpoint-4"]


def test_a_full_disk_while_saving_the_adapter_keeps_the_one_there(cli, disk, capsys):
    out = disk.root / "out"
    run = [*cli, "--max-steps", "1", "--output", str(out)]
    assert main(run) == 0
    before = {p.name: p.read_bytes() for p in (out / "adapter").iterdir()}
    summary = (out / "summary.json").read_text()

    disk.fill(leave=0)
    capsys.readouterr()
    assert main(run) == 2
    line = _error_line(capsys)
    assert line.startswith(f"pact finetune: error: no space left in {out} while saving adapter (needs about "), line
    assert line.endswith("MiB free); free space and run the same command again"), line
    assert {p.name: p.read_bytes() for p in (out / "adapter").iterdir()} == before  # not replaced by half of one
    assert (out / "summary.json").read_text() == summary
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".adapter")) == []

    disk.free()
    assert main(run) == 0 and (out / "adapter" / "adapter_model.safetensors").is_file()
