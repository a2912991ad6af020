"""Weight streaming (`WeightStream`, on in MemorySavers with mapped weights): the mapped frozen weights leave the
process's resident memory after each use, and nothing else changes."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import tiny_model
from peft import get_peft_model

from optimum_pact.dataflow import FrozenLinear
from optimum_pact.memory import MemorySavers, WeightStream
from optimum_pact.memory.streaming import _LayerStream
from peft_ext import PactConfig

SIZES = dict(hidden_size=256, intermediate_size=1024, vocab_size=16384, num_attention_heads=4, num_key_value_heads=2)


def _model(**overrides):
    model = tiny_model("qwen2", **{**SIZES, "tie_word_embeddings": True, **overrides})
    return get_peft_model(model, PactConfig(r=4, target_modules="all-linear", init_lora_weights=False)).train()


def _batch(seed=1):
    ids = torch.randint(0, SIZES["vocab_size"], (2, 48), generator=torch.Generator().manual_seed(seed))
    labels = ids.clone()
    labels[:, :16] = -100
    return ids, labels


def _train(preset: str, stream: bool, tmp_path, steps: int = 3, **options):
    """Losses and adapter gradients of `steps` AdamW steps under the savers `preset`, streamed or not."""
    model = _model()
    ids, labels = _batch()
    out = []
    with MemorySavers.from_preset(model, preset, offload_dir=tmp_path, stream_weights=stream, **options) as savers:
        assert (savers.stream is not None) == stream
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        for _ in range(steps):
            loss = model(input_ids=ids, labels=labels).loss
            loss.backward()
            out.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
            opt.step()
            opt.zero_grad(set_to_none=True)
        releases = savers.stream.releases if stream else 0
    return out, releases


@pytest.mark.parametrize("preset,options", [("exact", {}), ("full", {"subset_k": 64})])
def test_streamed_training_gives_the_same_losses_and_gradients(preset, options, tmp_path):
    streamed, releases = _train(preset, True, tmp_path / "s", **options)
    plain, _ = _train(preset, False, tmp_path / "p", **options)
    assert releases > 100  # the pages really were handed back, many times a step
    for (loss, grads), (loss_ref, grads_ref) in zip(streamed, plain):
        torch.testing.assert_close(loss, loss_ref, atol=1e-6, rtol=0)
        assert grads.keys() == grads_ref.keys() and len(grads) == 2 * 7 * 2  # A and B of 7 linears x 2 blocks
        for name in grads_ref:
            torch.testing.assert_close(grads[name], grads_ref[name], atol=1e-6, rtol=0, msg=name)


def _smaps_rss(path_part: str) -> int:
    """Rss of this process's mappings whose path contains `path_part`, from /proc/self/smaps (bytes)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            first = line.split(maxsplit=1)[0]
            if "-" in first and not first.endswith(":"):  # a mapping's header line
                inside = path_part in line
            elif inside and first == "Rss:":
                total += int(line.split()[1]) * 1024
    return total


def test_resident_pages_of_the_weights_file_stay_under_the_window(tmp_path, monkeypatch):
    window = 256 * 2**10
    model = _model(num_hidden_layers=4)
    ids, labels = _batch()
    seen = []  # resident bytes of the mapping at the end of every product, before its release
    after = _LayerStream.after
    monkeypatch.setattr(
        _LayerStream, "after", lambda self, kind: (seen.append(self.stream.resident_bytes()), after(self, kind))
    )
    with MemorySavers.from_preset(model, "full", offload_dir=tmp_path, subset_k=64, window_bytes=window) as savers:
        stream, mapped = savers.stream, sum(t.numel() * t.element_size() for t in savers.mapped_weights)
        assert stream.layers == 4 * 7 and mapped > 18 * 2**20  # 16 MiB table + 28 packed linears
        for _ in range(2):
            model(input_ids=ids, labels=labels).loss.backward()
        assert _smaps_rss("pact-weights-") <= window  # after a step (read as the kernel reports it)
        largest = max(layer.nbytes for _, layer in stream._layers)
        # during it: the layer being multiplied, the table rows read since the last release, and up to two page-cache
        # folios (2 MiB each) the kernel mapped around the pages touched
        # forward, recomputation and input gradient of 28 linears, less block 0's q/k/v input gradients (their input,
        # the frozen embedding's output, needs none)
        assert len(seen) == 2 * (3 * 28 - 3) and max(seen) <= largest + window + 4 * 2**20 < mapped / 4
        savers.stream.close()
        savers.stream = None
        model(input_ids=ids, labels=labels).loss.backward()  # not streamed: every page a step touches stays
        assert _smaps_rss("pact-weights-") > 0.9 * mapped


def test_release_never_touches_memory_outside_the_weights_file(tmp_path):
    model = _model(num_hidden_layers=1)
    with MemorySavers.from_preset(model, "exact", offload_dir=tmp_path) as savers:
        plain = torch.arange(100_000, dtype=torch.float32)  # anonymous memory: MADV_DONTNEED would zero it
        lo = plain.data_ptr()
        with pytest.raises(ValueError, match="is not in the mapping of"):
            savers.stream.advise(lo, lo + 4 * plain.numel(), 4)
        assert torch.equal(plain, torch.arange(100_000, dtype=torch.float32))
        layer = next(m for m in model.modules() if isinstance(m, FrozenLinear))
        assert layer.stream is not None
    assert layer.stream is None  # close() took the hooks off


def test_stream_options_are_checked(tmp_path):
    model = _model(num_hidden_layers=1)
    with pytest.raises(ValueError, match="stream_weights=True needs map_weights=True"):
        MemorySavers(model, offload_dir=tmp_path, map_weights=False, stream_weights=True)
    with pytest.raises(ValueError, match="window_bytes=100 must be an integer >= 4096"):
        MemorySavers(model, offload_dir=tmp_path, map_weights=True, window_bytes=100)
    with pytest.raises(RuntimeError, match="is not mapped in this process"):
        WeightStream(model, type("F", (), {"device": 0, "inode": 1, "path": "nowhere"})())


TRUNCATE = """
import json, os, sys
import torch
from datasets import Dataset
from peft import PeftModel, get_peft_model
from transformers import TrainerCallback
sys.path.insert(0, {tests!r})
from conftest import tiny_model
from optimum_pact.memory import WeightsFileError
from peft_ext import PactConfig
from trainer_callbacks import PactTrainer, PactTrainingArguments

torch.manual_seed(0)
ids = torch.randint(0, 128, (8, 24))
data = Dataset.from_dict({{"input_ids": ids.tolist(), "labels": ids.tolist()}})

class Truncate(TrainerCallback):
    def on_step_end(self, args, state, control, **kw):
        if state.global_step == 2:
            file = trainer.memory_savers.weights_file
            os.truncate(f"/proc/self/fd/{{file.fd}}", file.size // 3)  # as a careless cleaner would

model = get_peft_model(tiny_model(), PactConfig(r=4, target_modules="all-linear"))
args = PactTrainingArguments(output_dir={out!r}, report_to="none", use_cpu=True, disable_tqdm=True,
    per_device_train_batch_size=4, max_steps=5, save_strategy="steps", save_steps=1, pact_memory_saver="exact")
trainer = PactTrainer(model=model, args=args, train_dataset=data, callbacks=[Truncate()])
try:
    trainer.train()
    error = None
except WeightsFileError as err:
    error = str(err)
base = tiny_model()
loaded = PeftModel.from_pretrained(base, os.path.join({out!r}, "checkpoint-2"))
out = loaded(input_ids=ids[:1]).logits
print(json.dumps({{"error": error, "checkpoints": sorted(os.listdir({out!r})), "finite": bool(out.isfinite().all())}}))
"""


def test_weights_file_truncated_mid_run_is_a_clear_error_and_checkpoints_survive(tmp_path):
    # a fresh interpreter: the mapping of a truncated file raises SIGBUS on any read the check did not stop
    code = TRUNCATE.format(tests=os.path.dirname(__file__), out=str(tmp_path / "run"))
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "was cut from" in result["error"] and "the last checkpoint is intact" in result["error"]
    assert [c for c in result["checkpoints"] if c.startswith("checkpoint-")] == ["checkpoint-1", "checkpoint-2"]
    assert result["finite"]  # checkpoint-2 loads in stock peft and runs


@pytest.mark.parametrize("native", ["0", "1"])
def test_rows_are_read_from_the_file_not_through_the_mapping(native, tmp_path, monkeypatch):
    monkeypatch.setenv("PACT_DISABLE_NATIVE", "1" if native == "0" else "0")  # the C kernel and the Python loop
    model = _model(num_hidden_layers=1)
    with MemorySavers.from_preset(model, "full", offload_dir=tmp_path, subset_k=64) as savers:
        stream, embedding = savers.stream, model.get_input_embeddings()
        ids = torch.randint(0, SIZES["vocab_size"], (2, 300), generator=torch.Generator().manual_seed(0))
        stream.release_all()
        rows, looked_up = stream.gather(embedding.weight, ids[0]), embedding(ids)
        # a lookup through the mapping would have mapped the page-cache folio around every row: most of the table
        assert stream.resident_bytes() == 0
        assert torch.equal(rows, embedding.weight[ids[0]])
        assert torch.equal(looked_up, torch.nn.functional.embedding(ids, embedding.weight))
        assert stream.resident_bytes() > 100 * 4096  # the reference lookups above read through the mapping
    assert "forward" not in vars(embedding)  # close() put the embedding's own forward back
