"""Verified, atomically committed Trainer checkpoints: a checksum manifest, commit by rename, corrupt fallback.

The Trainer writes a checkpoint into `<output_dir>/checkpoint-N` (its own format: adapter, optimizer, scheduler,
RNG states, trainer_state.json). `commit_checkpoint` fsyncs it, writes `pact_checkpoint.json` (sha256 and size of
every file, the data position and the run's identity) by temp file + fsync + rename, then renames the whole folder
into `<output_dir>/checkpoints/`, so that folder only ever holds complete checkpoints. `find_checkpoint` returns the
newest one whose checksums verify and whose files the Trainer can read back (`check_contents`: damage from before
the checkpoint was sealed), moving corrupt ones aside, and refuses one written for another base model or adapter
configuration.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import time
from collections.abc import Iterable
from pathlib import Path

import torch

from optimum_pact.files import fsync_dir, sha256_file, why_unreadable, write_text_atomic

logger = logging.getLogger(__name__)

MANIFEST_NAME = "pact_checkpoint.json"
STAGING_MARKER = ".pact-staging"
CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")
FORMAT_VERSION = 1
REQUIRED_FILES = ("trainer_state.json",)
# LoRA config fields that do not change what is trained.
_VOLATILE_ADAPTER_KEYS = {"base_model_name_or_path", "revision", "inference_mode", "runtime_config", "peft_version"}
_SAMPLES_PER_TENSOR = 1 << 16


class CorruptCheckpointError(ValueError):
    """A checkpoint whose manifest is missing or damaged, or whose files do not match their checksums or cannot be
    read back (the message starts with the checkpoint folder and names the file)."""


def write_json_atomic(path: Path, data: dict) -> None:
    """Write JSON to `path` via a temp file in the same folder, fsync, rename, fsync the folder."""
    write_text_atomic(path, json.dumps(data, indent=2, sort_keys=True) + "\n")


def _jsonable(value):
    if isinstance(value, (set, frozenset)):
        return sorted(_jsonable(v) for v in value)
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def _base_fingerprint(model: torch.nn.Module) -> str:
    """sha256 over the name, shape, dtype and a strided sample of every frozen tensor (LoRA weights excluded)."""
    digest = hashlib.sha256()
    tensors = [(n, t) for n, t in model.named_parameters() if not t.requires_grad]
    tensors += list(model.named_buffers())
    for name, tensor in sorted(tensors, key=lambda item: item[0]):
        if "lora_" in name:
            continue
        flat = tensor.detach().reshape(-1)
        step = max(1, flat.numel() // _SAMPLES_PER_TENSOR)
        sample = flat[::step].contiguous().cpu()
        digest.update(f"{name}|{tuple(tensor.shape)}|{tensor.dtype}|".encode())
        digest.update(sample.view(torch.uint8).numpy().tobytes() if sample.numel() else b"")
    return digest.hexdigest()


def model_identity(model: torch.nn.Module) -> dict:
    """What a checkpoint must match to be resumed into `model`: the adapter configuration and the frozen base."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = getattr(base, "config", None)
    adapter: dict = {}
    peft_config = getattr(model, "peft_config", None)
    if isinstance(peft_config, dict):
        for adapter_name, cfg in sorted(peft_config.items()):
            fields = {k: v for k, v in cfg.to_dict().items() if k not in _VOLATILE_ADAPTER_KEYS}
            if hasattr(cfg, "pact_dict"):
                fields.update({f"pact.{k}": v for k, v in cfg.pact_dict().items()})
            adapter[adapter_name] = _jsonable(fields)
    return {
        "base_model": str(getattr(config, "_name_or_path", "") or type(base).__name__),
        "base_fingerprint": _base_fingerprint(base),
        "adapter": adapter,
    }


def identity_mismatch(saved: dict, current: dict) -> str | None:
    """Why a checkpoint with identity `saved` cannot be resumed into a run with identity `current` (None: it can)."""
    # the base first: another base also changes what is derived from its weights (AQLoRA's protected list)
    if saved.get("base_fingerprint") != current.get("base_fingerprint"):
        return (
            f"a different base model: checkpoint {saved.get('base_model')!r} (fingerprint "
            f"{str(saved.get('base_fingerprint'))[:12]}), this run {current.get('base_model')!r} (fingerprint "
            f"{str(current.get('base_fingerprint'))[:12]})"
        )
    if saved.get("adapter") != current.get("adapter"):
        old, new = saved.get("adapter", {}), current.get("adapter", {})
        diffs = []
        for name in sorted(set(old) | set(new)):
            a, b = old.get(name, {}), new.get(name, {})
            for key in sorted(set(a) | set(b)):
                if a.get(key) != b.get(key):
                    diffs.append(f"{name}.{key}: checkpoint {a.get(key)!r}, this run {b.get(key)!r}")
        return "a different adapter configuration (LoRA/PactConfig): " + "; ".join(diffs[:6] or ["adapters differ"])
    return None


def checkpoint_step(path: Path) -> int:
    match = CHECKPOINT_RE.match(Path(path).name)
    return int(match.group(1)) if match else -1


def list_checkpoints(checkpoints_dir: str | Path) -> list[Path]:
    """Committed checkpoint folders in `checkpoints_dir`, oldest step first."""
    folder = Path(checkpoints_dir)
    if not folder.is_dir():
        return []
    found = [p for p in folder.iterdir() if p.is_dir() and CHECKPOINT_RE.match(p.name)]
    return sorted(found, key=checkpoint_step)


def _payload_files(folder: Path) -> Iterable[Path]:
    for path in sorted(folder.rglob("*")):
        if path.is_file() and path.name not in (MANIFEST_NAME, STAGING_MARKER) and not path.name.endswith(".tmp"):
            yield path


def commit_checkpoint(staging: str | Path, checkpoints_dir: str | Path, info: dict) -> Path:
    """Seal the Trainer's checkpoint folder `staging` and move it into `checkpoints_dir` in one rename.

    Every file is fsynced, then the manifest (checksums, sizes and `info`) is written atomically, then the folder
    is renamed. An older folder of the same name (a corrupt one being replaced) is moved aside first.
    """
    staging, checkpoints_dir = Path(staging), Path(checkpoints_dir)
    files = {}
    for path in _payload_files(staging):
        with open(path, "rb") as f:
            os.fsync(f.fileno())
        files[path.relative_to(staging).as_posix()] = {"sha256": sha256_file(path), "bytes": path.stat().st_size}
    missing = [name for name in REQUIRED_FILES if name not in files]
    if missing:
        raise CorruptCheckpointError(f"{staging} lacks {missing}; the Trainer did not finish writing it.")
    manifest = {"format": FORMAT_VERSION, "created": time.time(), "files": files, **_jsonable(info)}
    write_json_atomic(staging / MANIFEST_NAME, manifest)
    (staging / STAGING_MARKER).unlink(missing_ok=True)
    fsync_dir(staging)
    checkpoints_dir.mkdir(parents=True, exist_ok=True)
    target = checkpoints_dir / staging.name
    if target.exists():
        _discard(target)
    os.replace(staging, target)
    fsync_dir(checkpoints_dir)
    fsync_dir(staging.parent)
    return target


def _manifest_entry(folder: Path, name, expected) -> Path:
    """The file a manifest entry names, after checking the entry's form (CorruptCheckpointError)."""
    relative = Path(name) if isinstance(name, str) and name else None
    if relative is None or relative.is_absolute() or ".." in relative.parts:
        raise CorruptCheckpointError(f"{folder}: {MANIFEST_NAME} lists {name!r}, outside the checkpoint")
    if (
        not isinstance(expected, dict)
        or not isinstance(expected.get("sha256"), str)
        or isinstance(expected.get("bytes"), bool)
        or not isinstance(expected.get("bytes"), int)
    ):
        raise CorruptCheckpointError(f"{folder}: {MANIFEST_NAME} lists {name} without its size and sha256")
    return folder / relative


def read_manifest(folder: str | Path) -> dict:
    """The manifest of a committed checkpoint, after checking every file against it and that the Trainer can read
    the files back (`check_contents`); CorruptCheckpointError naming the file otherwise."""
    folder = Path(folder)
    try:
        manifest = json.loads((folder / MANIFEST_NAME).read_text())
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{folder}: no {MANIFEST_NAME} (not committed)") from None
    except (OSError, ValueError) as err:
        raise CorruptCheckpointError(f"{folder}: unreadable {MANIFEST_NAME} ({err})") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise CorruptCheckpointError(f"{folder}: {MANIFEST_NAME} has no file list")
    if not isinstance(manifest.get("identity", {}), (dict, type(None))):
        raise CorruptCheckpointError(f"{folder}: {MANIFEST_NAME} has no valid identity")
    for name, expected in manifest["files"].items():
        path = _manifest_entry(folder, name, expected)
        try:
            if not path.is_file():
                raise CorruptCheckpointError(f"{folder}: {name} is missing")
            size = path.stat().st_size
            if size != expected["bytes"]:
                raise CorruptCheckpointError(f"{folder}: {name} has {size} bytes, expected {expected['bytes']}")
            if sha256_file(path) != expected["sha256"]:
                raise CorruptCheckpointError(f"{folder}: {name} does not match its sha256")
        except OSError as err:
            raise CorruptCheckpointError(f"{folder}: {name} cannot be read ({err})") from None
    check_contents(folder)
    return manifest


def check_contents(folder: str | Path) -> None:
    """Check that the Trainer can read back every file of checkpoint `folder`: JSON files parse, safetensors
    headers cover their file, torch.save archives pass their CRC checks, an adapter has its weights.

    Checksums cannot see damage done before a checkpoint was sealed, nor any in a Trainer checkpoint without a
    manifest; this can. Raises CorruptCheckpointError naming the first damaged file.
    """
    folder = Path(folder)
    for path in _payload_files(folder):
        problem = why_unreadable(path)
        if problem is not None:
            raise CorruptCheckpointError(f"{folder}: {path.relative_to(folder).as_posix()} is damaged ({problem})")
    if (folder / "adapter_config.json").is_file() and not any(
        (folder / name).is_file() for name in ("adapter_model.safetensors", "adapter_model.bin")
    ):
        raise CorruptCheckpointError(
            f"{folder}: adapter_config.json is there but adapter_model.safetensors is missing"
        )


def _discard(folder: Path) -> None:
    """Remove `folder` so that it leaves the committed set at once: rename it aside, then delete it."""
    trash = folder.with_name(f".deleting-{folder.name}-{os.getpid()}-{time.monotonic_ns()}")
    os.replace(folder, trash)
    shutil.rmtree(trash, ignore_errors=True)


def quarantine(folder: Path) -> Path:
    """Move a corrupt checkpoint out of the committed set, to `<name>.corrupt` (replacing an older one)."""
    target = folder.with_name(folder.name + ".corrupt")
    if target.is_dir() and not target.is_symlink():
        shutil.rmtree(target, ignore_errors=True)
    elif target.exists() or target.is_symlink():
        target.unlink()
    os.replace(folder, target)
    return target


def find_checkpoint(
    checkpoints_dir: str | Path, model: torch.nn.Module | None = None, move_corrupt: bool = True
) -> Path | None:
    """The newest committed checkpoint in `checkpoints_dir` whose files verify, or None when there is none.

    Corrupt ones (see `read_manifest`) are reported (warning) and, with `move_corrupt`, renamed to
    `<name>.corrupt`; the next older one is tried, and a warning says so when none is left. With `model`, a
    checkpoint written for another base model or adapter configuration is refused with a ValueError saying why (it
    is not skipped: the folder belongs to another run).
    """
    current = model_identity(model) if model is not None else None
    skipped = 0
    for folder in reversed(list_checkpoints(checkpoints_dir)):
        try:
            manifest = read_manifest(folder)
        except CorruptCheckpointError as err:
            skipped += 1
            where = "left in place"
            if move_corrupt:
                try:
                    where = f"moved to {quarantine(folder)}"
                except OSError as move_err:
                    where = f"could not be moved aside ({move_err}): delete it"
            logger.warning(f"resumable: corrupt checkpoint skipped: {err}; {where}; trying an older one.")
            continue
        if current is not None:
            reason = identity_mismatch(manifest.get("identity") or {}, current)
            if reason is not None:
                raise ValueError(
                    f"refusing to resume from {folder}: it was written for {reason}. Use another output directory "
                    f"for this run, or delete {Path(checkpoints_dir)} to start over."
                )
        return folder
    if skipped:
        kept = "kept as *.corrupt: delete them once inspected" if move_corrupt else "left in place"
        logger.warning(
            f"resumable: no valid checkpoint is left in {checkpoints_dir} ({skipped} damaged, {kept}); a run "
            "resumed from this folder starts from step 0."
        )
    return None


def rotate_checkpoints(checkpoints_dir: str | Path, keep: int | None) -> list[Path]:
    """Delete all but the newest `keep` committed checkpoints (None keeps all); returns the deleted ones."""
    if keep is None:
        return []
    if keep < 1:
        raise ValueError(f"keep={keep!r} must be at least 1 (or None to keep every checkpoint).")
    old = list_checkpoints(checkpoints_dir)[:-keep]
    for folder in old:
        _discard(folder)
    return old


def folder_bytes(folder: str | Path) -> int:
    return sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file())
