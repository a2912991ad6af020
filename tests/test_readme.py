"""Every command README.md shows runs as written, in order, in one folder, as a person who copies them would.

The fenced ```bash blocks' commands (set-up steps aside: the venv, pip, pytest) and the ```python blocks run one
after another in a folder laid out like a clone (examples/ beside it), with the installed `pact` first on PATH; so a
path a later command uses (the main job's `pact-output/adapter`) is made by the commands before it. A command that
fails, or prints a traceback, fails the test. Slow: the main job trains the real default model.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^```(\w+)[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)
SET_UP = ("python3 -m venv", ". .venv/bin/activate", "source ", "pip ", "python -m pytest", "CMAKE_ARGS=")


def shell_commands(block: str) -> list[str]:
    """The commands of a bash block: continuation lines joined, comments dropped, `a && b` split in two."""
    text = re.sub(r"\s*\\\n\s*", " ", block)
    commands = []
    for line in text.splitlines():
        line = line.split(" #", 1)[0].strip() if not line.lstrip().startswith("#") else ""
        commands += [part.strip() for part in line.split("&&") if part.strip()]
    return commands


def readme_steps(text: str) -> list[tuple[str, str]]:
    """("bash", command) and ("python", code) in the order README.md shows them, set-up steps left out."""
    steps = []
    for lang, body in FENCE.findall(text):
        if lang == "bash":
            steps += [("bash", c) for c in shell_commands(body) if not c.startswith(SET_UP)]
        elif lang == "python":
            steps.append(("python", body))
    return steps


def test_readme_steps_are_read_as_a_person_types_them():
    text = (
        "```bash\npython3 -m venv .venv && . .venv/bin/activate && pip install x && pact finetune\n"
        "python -m pytest\n```\n"
        '```bash\npact generate --adapter pact-output/adapter \\\n    "a note"  # tags it\n'
        "# a comment\necho hi | pact chat --adapter a=x\n```\n```python\nprint(1)\n```\n```text\npact nothing\n```\n"
    )
    assert readme_steps(text) == [
        ("bash", "pact finetune"),
        ("bash", 'pact generate --adapter pact-output/adapter "a note"'),
        ("bash", "echo hi | pact chat --adapter a=x"),
        ("python", "print(1)\n"),
    ]


def test_readme_shows_the_main_job_and_uses_its_adapter():
    steps = readme_steps((ROOT / "README.md").read_text())
    commands = [step for kind, step in steps if kind == "bash"]
    assert commands[0] == "pact finetune"  # the first set-up command's main job
    assert any("pact-output/adapter" in c for c in commands[1:])


@pytest.mark.slow
def test_every_readme_command_runs_as_written(tmp_path):
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    bin_dir = str(Path(sys.executable).parent)
    env = {**os.environ, "PATH": bin_dir + os.pathsep + os.environ.get("PATH", "")}
    for index, (kind, step) in enumerate(readme_steps((ROOT / "README.md").read_text())):
        argv = ["bash", "-o", "pipefail", "-c", step] if kind == "bash" else [sys.executable, "-c", step]
        proc = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
        shown = f"README step {index} ({kind}):\n{step}\n--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n"
        shown += proc.stderr[-3000:]
        assert proc.returncode == 0, shown
        assert "Traceback" not in proc.stdout + proc.stderr, shown
