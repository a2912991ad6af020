"""Every command README.md shows runs as written, in order, in one folder, as a person who copies them would.

The fenced ```bash blocks' commands (set-up steps aside: the venv, pip, pytest) and the ```python blocks run one
after another in a folder laid out like a clone (examples/ beside it), with the installed `pact` first on PATH; so a
path a later command uses (the main job's `pact-output/adapter`) is made by the commands before it. A command that
fails, or prints a traceback, fails the test. Slow: the main job trains the real default model.
"""

from __future__ import annotations

import json
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


def shown_problems(step: str, stdout: str, cwd: Path) -> list[str]:
    """What is wrong with what `step` printed, against what README.md shows it prints: a tagging adapter answers
    with one of its tags (generate: the whole answer; chat: each `> ` line), a finetune reports its held-out
    accuracy, a GGUF export its file's own accuracy in llama.cpp, a merged-bf16 export writes a loadable folder."""
    problems = []
    record = cwd / "pact-output" / "adapter" / "pact_data.json"
    tags = set(json.loads(record.read_text())["labels"]) if record.is_file() else set()
    tagging = "pact-output/adapter" in step and "--use" not in step  # the main job's adapter, either engine
    if step.startswith("pact finetune") and "held-out" not in stdout:
        problems.append("the summary reports no held-out score")
    if step.startswith("pact generate") and tagging and stdout.strip() not in tags:
        problems.append(f"answered {stdout.strip()!r}, not one of the adapter's tags {sorted(tags)}")
    if "pact chat" in step and tagging:
        answers = [line[2:].strip() for line in stdout.splitlines() if line.startswith("> ")]
        answers = answers[:-1] if answers and not answers[-1] else answers  # the prompt that met the end of input
        if not answers or not set(answers) <= tags:
            problems.append(f"chat answered {answers}, not tags of {sorted(tags)}")
    if step.startswith("pact export --format gguf ") and not re.search(r"accuracy of \S+ in llama\.cpp: \d", stdout):
        problems.append("the GGUF export does not report the file's own accuracy in llama.cpp")
    if step.startswith("pact export --adapter") and "--format" not in step:
        output = step.split("--output")[1].split()[0]
        if not (cwd / output / "config.json").is_file():
            problems.append(f"{output} holds no config.json")
    return problems


def test_what_the_readme_shows_is_checked(tmp_path):
    (tmp_path / "pact-output" / "adapter").mkdir(parents=True)
    (tmp_path / "pact-output" / "adapter" / "pact_data.json").write_text('{"labels": ["kin", "mend"]}')
    generate = 'pact generate --adapter pact-output/adapter "a note"'
    assert shown_problems(generate, "kin\n", tmp_path) == []
    assert shown_problems(generate, "kin kin kin kin\n", tmp_path) != []  # an answer that repeats a word
    chat = "printf 'a\\nb\\n' | pact chat --adapter pact-output/adapter"
    assert shown_problems(chat, "note: this adapter tags notes\n> kin\n> mend\n> ", tmp_path) == []
    assert shown_problems(chat, "> kin\n> \n> ", tmp_path) != []  # an empty answer to a message
    assert shown_problems(chat, "> kin\n> Sure! Here is\n", tmp_path) != []
    gguf = "pact export --format gguf --adapter pact-output/adapter --output notes.gguf"
    assert shown_problems(gguf, "held-out accuracy of notes.gguf in llama.cpp: 85.0% (the file)\n", tmp_path) == []
    assert shown_problems(gguf, "exported pact-output/adapter as gguf: notes.gguf\n", tmp_path) != []
    assert shown_problems("pact finetune", "PACT fine-tune summary\n", tmp_path) != []


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
        problems = shown_problems(step, proc.stdout, tmp_path) if kind == "bash" else []
        assert not problems, (problems, shown)
