"""The quantized base, kept once: `pact generate`, `pact chat` and `PactModelForCausalLM` load the NVFP4 base from a
saved PACT checkpoint in PACT's cache instead of quantizing the full-precision one on every call (the block-scale
search is most of a cold start: about 3 s of SmolLM2-135M's on 2 cores).

One folder per (base checkpoint, dtype, linears kept 16-bit): `cache_dir("packed", <name>-<key>)`, written by
`save_pretrained` (packed codes, e4m3 scales, 16-bit linears and the rest as loaded) and read back memory-mapped
by safetensors. The key hashes the base's config.json and safetensors files (name, size, modification time), the
dtype, the 16-bit set and this format's version: a changed base or another adapter's precision gets a new folder.
The model read back is the model built from the checkpoint, bit for bit (tests/test_packed_cache.py). The cache keeps
the KEEP folders used last and deletes older ones as it writes a new one; a Hub id (no local files to key on) is never
cached.
"""

from __future__ import annotations

import gc
import hashlib
import json
import logging
import os
import shutil
from pathlib import Path

import torch

from .. import __version__
from ..cache import cache_dir
from .rounded_base import apply_codes, read_codes

logger = logging.getLogger(__name__)

FORMAT = 1  # raise when what a cached folder holds changes
KEEP = 4  # packed bases kept: the ones used last


def packed_folder(
    path: str, dtype: torch.dtype, sixteen_bit: list[str] | None, codes: Path | None = None
) -> Path | None:
    """Where the packed base of the checkpoint at `path` in `dtype` with `sixteen_bit` linears is cached (None: a
    Hub id, or a folder that is already packed); `codes`: an adapter's own rounding of it (`rounded_base`)."""
    folder = Path(path)
    files = sorted([*folder.glob("*.safetensors"), folder / "config.json"])
    if not folder.is_dir() or not all(file.is_file() for file in files) or len(files) < 2:
        return None
    if (json.loads((folder / "config.json").read_text()).get("quantization_config") or {}).get("quant_method"):
        return None  # already quantized: loading it quantizes nothing
    settings = [str(dtype), sorted(sixteen_bit or []), FORMAT]
    if codes is not None:  # the file itself, as the checkpoint's files are named: a retrained adapter's is new
        stat = codes.stat()
        settings.append([str(Path(codes).resolve()), stat.st_size, stat.st_mtime_ns])
    return cache_dir("packed", checkpoint_key(folder, files, *settings))


def checkpoint_key(folder: Path, files: list[Path], *settings) -> str:
    """`<folder name>-<hash>`, naming what PACT caches from the checkpoint `folder`: the hash of its resolved path,
    its `files` (name, size, modification time: a changed checkpoint gets a new key), `settings` (JSON values) and
    this version of PACT."""
    stats = [(file.name, file.stat().st_size, file.stat().st_mtime_ns) for file in files]
    key = json.dumps([str(folder.resolve()), stats, *settings, __version__])
    return f"{folder.name}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def load_packed(path: str, given: str | None, quantization, dtype: torch.dtype, codes: Path | None = None):
    """The base at `path` on PACT's NVFP4 layers (`quantization`: a PactQuantizationConfig), read from its cached
    packed folder, which is written on the first call; with `codes` (an adapter's `pact_base.safetensors`) its NVFP4
    linears hold that rounding. The model names `path` as where it came from (what peft records as an adapter's
    base_model_name_or_path), never the cache."""
    model = _load_packed(path, given, quantization, dtype, codes)
    model.config._name_or_path = model.name_or_path = path
    return model


def _load_packed(path: str, given: str | None, quantization, dtype: torch.dtype, codes: Path | None):
    from .model_folder import load_causal_lm, written_aside  # transformers: `packed_folder` alone stays light

    cached = packed_folder(path, dtype, quantization.modules_in_16bit, codes)
    if cached is not None and (cached / "config.json").is_file():
        try:
            model = load_causal_lm(str(cached), given, quantization_config=quantization, dtype=dtype)
            os.utime(cached)  # used now: kept over older ones
            return model
        except ValueError as err:  # damaged: build it again below
            logger.warning("the cached packed base %s did not load (%s); quantizing the base again", cached, err)
    model = load_causal_lm(path, given, quantization_config=quantization, dtype=dtype)
    if codes is not None:
        apply_codes(model, read_codes(codes))
    if cached is not None:
        try:
            with written_aside(cached, replace=True) as tmp:
                model.save_pretrained(tmp)
            _evict(cached.parent, KEEP)
        except OSError as err:  # a full or read-only cache costs the next call its time, nothing else
            logger.warning("could not cache the packed base in %s (%s); the next call quantizes it again", cached, err)
        else:
            # read back as every later call reads it: the tensors kept 16-bit are views of the full-precision
            # checkpoint's memory map otherwise, which keeps every page of that file resident for the whole run
            del model
            gc.collect()
            model = load_causal_lm(str(cached), given, quantization_config=quantization, dtype=dtype)
    return model


def _evict(root: Path, keep: int) -> None:
    """Delete all but the `keep` packed folders in `root` used last (a partial one being written is left alone)."""
    folders = sorted((f for f in root.iterdir() if f.is_dir() and not f.name.startswith(".")),
                     key=lambda f: f.stat().st_mtime_ns, reverse=True)  # fmt: skip
    for folder in folders[keep:]:
        shutil.rmtree(folder, ignore_errors=True)


__all__ = ["FORMAT", "KEEP", "checkpoint_key", "load_packed", "packed_folder"]
