"""`pact` prints no warnings, ours or a library's (issues 40, 49): the installed command, run as a user runs it.

Every extra installed (torchao, bitsandbytes, ...), in a fresh folder, as a subprocess: any line with a warning or a
"Failed to load", in any case ("WARNING optimum_pact...: " from a logger too), fails the test, whoever printed it.
transformers' own handler prints a bare message with no level; the command runs with that handler's explicit format
on (`[WARNING|file:line]`, its own switch), so such a message shows its level here and is caught too. Our progress
bars, summary and `[optimum-pact]` lines have none of these words.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from optimum_pact.commands.noise import KNOWN_LOG_MESSAGES, quiet_third_party

PACT = Path(sys.executable).with_name("pact")  # the console script pip installed next to this interpreter
NOISE = re.compile(r"warn|failed to load", re.IGNORECASE)
# what the console script runs, with transformers' handler labelling its bare messages ([WARNING|file:line] ...)
LABELLED = (
    "import sys; from transformers.utils import logging; logging.enable_explicit_format(); "
    "from optimum_pact.commands.cli import main; sys.exit(main())"
)
TINY_DATA = "\n".join(
    f'{{"text": "{text}", "label": "{label}", "split": "{split}"}}'
    for text, label, split in [("buy milk", "errand", "train"), ("call mum", "kin", "train"),
                               ("buy bread", "errand", "test"), ("call dad", "kin", "test")]
)  # fmt: skip  # held-out evaluation of 2 items, not the built-in 60


def pact(*args, cwd: Path, stdin: str = "") -> subprocess.CompletedProcess:
    if not PACT.is_file():
        pytest.skip(f"needs the installed `pact` console script ({PACT}): pip install -e .")
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "PYTHONWARNINGS")}  # a user's shell, CI or not
    command = [sys.executable, "-c", LABELLED] if args[0] != "--help" else [str(PACT)]
    proc = subprocess.run(
        [*command, *map(str, args)], cwd=cwd, env=env, input=stdin, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, f"pact {' '.join(map(str, args))} exited {proc.returncode}:\n{proc.stderr[-3000:]}"
    return proc


def noise(proc: subprocess.CompletedProcess) -> list[str]:
    """The lines (tqdm's \\r-separated updates counted apart) that are a third party's warning, not ours."""
    return [line for text in (proc.stdout, proc.stderr) for line in text.splitlines() if NOISE.search(line)]


def test_noise_is_caught_in_every_form_it_takes():
    printed = [
        "WARNING optimum_pact.commands.modeling: run/adapter was trained with some linears 16-bit",  # our logger
        "[WARNING|modeling_utils.py:123] 2026-12-06 >> Setting `pad_token_id` to `eos_token_id`",  # transformers
        "/venv/peft/peft_model.py:642: UserWarning: Found missing adapter keys",  # warnings.warn
        "Failed to load CPU gemm_4bit_forward from kernels-community",  # bitsandbytes
        "[optimum-pact] exporting run/adapter once for llama.cpp",  # ours, not noise
        "kin",
    ]
    proc = subprocess.CompletedProcess([], 0, stdout="\n".join(printed[:2]), stderr="\n".join(printed[2:]))
    assert noise(proc) == printed[:4]


@pytest.fixture(scope="module")
def trained(small_model, tmp_path_factory):
    """`pact finetune` for 2 steps on the small model, in a fresh folder: (that folder, the finished process)."""
    cwd = tmp_path_factory.mktemp("quiet")
    (cwd / "tiny.jsonl").write_text(TINY_DATA + "\n")
    proc = pact("finetune", "--model", small_model, "--data", "tiny.jsonl", "--max_steps", "2", "--output", "run",
                cwd=cwd)  # fmt: skip
    return cwd, proc


def test_help_prints_only_the_usage(tmp_path):
    proc = pact("--help", cwd=tmp_path)
    assert not noise(proc) and proc.stderr == "", proc.stderr
    assert proc.stdout.startswith("pact: on-device LoRA fine-tuning.")


def test_finetune_prints_only_ours(trained):
    _, proc = trained
    assert not noise(proc), noise(proc)
    assert "PACT fine-tune summary" in proc.stdout


@pytest.mark.parametrize(
    "args, stdin",
    [
        pytest.param(["generate", "--adapter", "run/adapter", "hi", "--max_new_tokens", "4"], "", id="generate"),
        pytest.param(["export", "--adapter", "run/adapter", "--output", "merged"], "", id="export-merged-bf16"),
        pytest.param(["chat", "--adapter", "run/adapter", "--max_new_tokens", "4"], "hi\n/quit\n", id="chat",
                     marks=pytest.mark.slow),
        pytest.param(["export", "--format", "gguf-lora", "--adapter", "run/adapter", "--output", "lora.gguf"], "",
                     id="export-gguf-lora", marks=pytest.mark.slow),
        pytest.param(["export", "--format", "nvfp4-merged", "--adapter", "run/adapter", "--output", "nvfp4",
                      "--data", "tiny.jsonl"], "", id="export-nvfp4-merged", marks=pytest.mark.slow),
    ],
)  # fmt: skip
def test_using_the_adapter_prints_only_ours(trained, small_model, args, stdin):
    cwd, _ = trained
    proc = pact(*args, "--model", small_model, cwd=cwd, stdin=stdin)
    assert not noise(proc), noise(proc)


@pytest.mark.slow
def test_main_job_prints_only_ours(main_job):
    """`pact finetune` with no options on the real default model (the session's one main-job run)."""
    _, proc = main_job
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not noise(proc), noise(proc)


def test_only_the_known_third_party_messages_are_dropped():
    loggers = {name: logging.getLogger(name) for name, _ in KNOWN_LOG_MESSAGES}
    before = {name: list(logger.filters) for name, logger in loggers.items()}
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("torchao").addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            quiet_third_party()
            quiet_third_party()  # idempotent: one filter per logger
            for name, pattern in KNOWN_LOG_MESSAGES:  # an earlier test's main() may have installed them already
                mine = [f for f in loggers[name].filters if getattr(getattr(f, "pattern", None), "pattern", None)]
                assert [f.pattern.pattern for f in mine].count(pattern) == 1, name
            torchao = logging.getLogger("torchao")
            torchao.warning("Failed to load /venv/site-packages/torchao/_C_mxfp8.cpython-310-x86_64-linux-gnu.so: no")
            torchao.warning("Failed to load the user's own file: a real problem")
            torchao.getChild("kernel").warning("Failed to load /venv/torchao/_C.so: kept (another logger's)")
            warnings.warn_explicit(
                "`is_gradient_checkpointing` is deprecated and will be removed in v6.", FutureWarning,
                "modeling_utils.py", 1, module="transformers.modeling_utils",
            )  # fmt: skip
            warnings.warn_explicit(
                "some other deprecation", FutureWarning, "modeling_utils.py", 2, module="transformers.modeling_utils"
            )
    finally:
        logging.getLogger("torchao").removeHandler(handler)
        for name, logger in loggers.items():
            logger.filters[:] = before[name]
    kept = [
        "Failed to load the user's own file: a real problem",
        "Failed to load /venv/torchao/_C.so: kept (another logger's)",
    ]
    assert records == kept
    assert [str(w.message) for w in caught] == ["some other deprecation"]
