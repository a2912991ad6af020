import json
import logging
import os
import subprocess
import sys

import pytest
import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from transformers import (
    DataCollatorForSeq2Seq,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

VOCAB = 128  # the tiny models' vocabulary
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


def tiny_model(arch: str = "llama", seed: int = 0, **overrides):
    torch.manual_seed(seed)
    if arch == "llama":
        return LlamaForCausalLM(LlamaConfig(**{"vocab_size": VOCAB, **TINY, **overrides}))
    return Qwen2ForCausalLM(Qwen2Config(**{"vocab_size": VOCAB, **TINY, **overrides}))


def padded_collator() -> DataCollatorForSeq2Seq:
    """The main job's collator, on a word-level tokenizer over the tiny models' ids (pad id 0, right padding)."""
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t1")), pad_token="t0"
    )
    return DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=-100)


def train_lm(model, steps: int = 30, seed: int = 0) -> list[float]:
    """A plain training loop on random tokens: AdamW over the trainable parameters; returns the losses."""
    torch.manual_seed(seed)
    ids = torch.randint(0, 128, (4, 16))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def main_in_a_fresh_process(argv: list[str], modules: tuple[str, ...]) -> tuple[int, list[str], str, str]:
    """`pact ARGV` (cli.main) in a new interpreter: (its status, which of `modules` it imported, stdout, stderr)."""
    code = (
        f"import json, sys\nfrom optimum_pact.commands.cli import main\nrc = main({argv!r})\n"
        f"print(json.dumps([rc, sorted(m for m in {modules!r} if m in sys.modules)]))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    *out, last = done.stdout.strip().splitlines() or ["[-1, []]"]
    rc, imported = json.loads(last) if last.startswith("[") else (-1, [])
    return rc, imported, "\n".join(out), done.stderr


@pytest.fixture(params=["llama", "qwen2"])
def arch(request):
    return request.param


# In CI (CI=true) every extra is installed and a C compiler is there: a test that would skip there means a missing
# or broken dependency, so it fails instead. Only what cannot exist on the machine (CUDA) may skip.
MAY_SKIP_IN_CI = ("CUDA",)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if os.environ.get("CI", "").lower() in ("1", "true", "yes") and report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        if not any(word in reason for word in MAY_SKIP_IN_CI):
            report.outcome = "failed"
            report.longrepr = f"skipped in CI, where it must run ({reason}): install what it needs in .ci/run"


# What PACT builds from a model and keeps in its cache: the tests' throwaway models must not fill it
BUILT = ("packed", "ranking")


@pytest.fixture(scope="session", autouse=True)
def cache_apart(tmp_path_factory):
    """The session's PACT cache: links to the person's (downloaded models, compiled kernels) with its own packed
    bases and rankings. Written into the real cache, the tests' small models evicted a person's packed 1.5B base
    (packed/ keeps the last KEEP folders; a rebuild is minutes) and piled up rankings. Where the real cache does not
    exist yet (a clean CI machine) or $PACT_CACHE is set, it is used as it is."""
    from optimum_pact.cache import cache_dir

    real = cache_dir()
    if "PACT_CACHE" in os.environ or not real.is_dir():
        yield real
        return
    root = tmp_path_factory.mktemp("pact_cache")
    for entry in real.iterdir():
        if entry.name not in BUILT:
            (root / entry.name).symlink_to(entry)
    os.environ["PACT_CACHE"] = str(root)  # this process and the commands it starts
    try:
        yield root
    finally:
        del os.environ["PACT_CACHE"]


@pytest.fixture(scope="session")
def small_model(tmp_path_factory):
    """SmolLM2's tokenizer on a 2-block model of random weights: the main job's code path, in seconds."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from optimum_pact.commands.default_model import ensure_default_model

    folder = tmp_path_factory.mktemp("small_model")
    tokenizer = AutoTokenizer.from_pretrained(ensure_default_model())
    torch.manual_seed(0)  # the same weights every session: tests that train on it are not at the mercy of the draw
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def main_job(tmp_path_factory):
    """`pact finetune` with no options (the main job on the default model, minutes), run once for the tests that
    check it or use its adapter: (output folder, the finished process)."""
    out = tmp_path_factory.mktemp("main_job") / "run"
    command = [sys.executable, "-m", "optimum_pact.commands.cli", "finetune", "--output", str(out)]
    return out, subprocess.run(command, capture_output=True, text=True, timeout=1800)


@pytest.fixture(scope="session")
def main_job_merged(main_job, tmp_path_factory):
    """The main job's adapter merged as `pact export --format nvfp4-merged` merges it by default (GPTQ of the trained
    weights, its size budget), once for the tests that use it: (folder, report, the warnings it logged)."""
    from optimum_pact.commands.nvfp4_merge import export_nvfp4_merged

    out, proc = main_job
    assert proc.returncode == 0, proc.stderr[-3000:]
    folder = tmp_path_factory.mktemp("main_job_merged") / "merged"
    warnings: list[logging.LogRecord] = []
    catch = logging.Handler(logging.WARNING)
    catch.emit = warnings.append
    logging.getLogger().addHandler(catch)
    try:
        report = export_nvfp4_merged(out / "adapter", folder)
    finally:
        logging.getLogger().removeHandler(catch)
    return folder, report, [record.getMessage() for record in warnings]
