"""Small file and process helpers shared by the model cache, the checkpoints, the output lock, the offloader, the
readers of user-supplied config files and the writers that must not leave half a file (atomic writes, full disks)."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import tempfile
import zipfile
from pathlib import Path

from safetensors import SafetensorError, safe_open


def sha256_file(path: str | Path) -> str:
    """Hex sha256 of a file, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def pid_alive(pid: int) -> bool:
    """Whether process `pid` exists (on POSIX; elsewhere, where `os.kill` would end it, assume it does)."""
    if os.name != "posix":
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def aside_folder(parent: Path, stem: str) -> Path:
    """A new private folder `.<stem>-<pid>-<random>` in `parent` to write into before renaming it into place. Ones
    that a dead process left (killed mid-write: SIGKILL, a timeout, power) are removed first, so that a killed export
    does not leave gigabytes behind; ones whose process still runs are left alone."""
    parent.mkdir(parents=True, exist_ok=True)
    for old in parent.glob(f".{stem}-*-*"):
        pid = old.name.removeprefix(f".{stem}-").split("-", 1)[0]
        if old.is_dir() and pid.isdigit() and int(pid) != os.getpid() and not pid_alive(int(pid)):
            shutil.rmtree(old, ignore_errors=True)
    return Path(tempfile.mkdtemp(dir=parent, prefix=f".{stem}-{os.getpid()}-"))


def read_json_object(path: str | Path, fix: str, label: str | None = None) -> dict:
    """The JSON object in config file `path`. A file that cannot be read, is empty, is not JSON or holds something
    else than an object is a ValueError saying which (`label`, default the path, leads it) and ending in `fix`."""
    label = label or str(path)
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"{label} cannot be read ({err}); {fix}") from None
    if not text.strip():
        raise ValueError(f"{label} is empty (an interrupted save, download or copy?); {fix}")
    try:
        data = json.loads(text)
    except ValueError as err:
        raise ValueError(f"{label} is not valid JSON ({err}): it is damaged or cut short; {fix}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{label} does not hold a JSON object (it holds a {type(data).__name__}); {fix}")
    return data


def fsync_dir(path: str | Path) -> None:
    """fsync a folder, so that a rename or a new file in it survives a power cut (a no-op where folders cannot be
    opened, e.g. on Windows)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write `text` to `path` through `path.tmp` in the same folder, fsync, rename, fsync the folder: a reader sees
    the old file or the new one, never a part of one. A failed write leaves the old file and no temp file."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


# How a full disk (or quota) reads when a library reports it in its own words: safetensors' Rust IoError, the
# strerror of ENOSPC / EDQUOT.
_DISK_FULL_WORDS = ("no space left on device", "disk quota exceeded", "storagefull", "os error 28", "os error 122")


def is_disk_full(err: BaseException) -> bool:
    """Whether `err`, or an exception it was raised from, says that the disk (or the user's quota) is full."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if any(words in str(err).lower() for words in _DISK_FULL_WORDS):
            return True
        err = err.__cause__ or err.__context__
    return False


def free_bytes(path: str | Path) -> int | None:
    """Bytes free to this user on the file system holding `path` (or its nearest existing parent); None if unknown."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def ran_out_of_space(err: BaseException, folder: str | Path, needed: int | None = None) -> bool:
    """Whether a write into `folder` that failed with `err` failed for lack of space: `err` says so (`is_disk_full`),
    or fewer than `needed` bytes are free there now, with what was written still in place. The second covers writers
    that lose the errno: torch.save reports a full disk as "unexpected pos"."""
    if is_disk_full(err):
        return True
    free = free_bytes(folder)
    return needed is not None and free is not None and free < needed


_JSON_OBJECTS = ("trainer_state.json", "adapter_config.json", "config.json")  # files that hold one JSON object


def why_unreadable(path: str | Path) -> str | None:
    """Why `path` cannot be read back (None: it can), by its kind: JSON parses, a safetensors header covers its
    file, a torch.save archive (.pt, .pth, .bin: a zip) passes its CRC checks. Other files are not looked into."""
    path = Path(path)
    try:
        if path.suffix == ".json":
            try:
                data = json.loads(path.read_text())
            except UnicodeDecodeError as err:
                return f"not text ({err})"
            except ValueError as err:
                return f"not valid JSON ({err})"
            if not isinstance(data, dict) and path.name in _JSON_OBJECTS:
                return "does not hold a JSON object"
        elif path.suffix == ".safetensors":
            try:
                with safe_open(str(path), framework="pt"):
                    pass
            except SafetensorError as err:
                return str(err).replace("Error while deserializing header: ", "") or type(err).__name__
        elif path.suffix in (".pt", ".pth", ".bin"):
            try:
                with zipfile.ZipFile(path) as archive:
                    bad = archive.testzip()
            except (zipfile.BadZipFile, EOFError, ValueError) as err:
                return f"not a complete torch.save archive ({err})"
            if bad is not None:
                return f"record {bad} fails its CRC check"
    except OSError as err:
        return f"cannot be read ({err})"
    return None
