"""Freed tensors leave the process instead of staying in glibc's heap: trim_heap / pact_trim_heap after each step
(the default), or pin_mmap_threshold / pact_mmap_threshold (asked for).

Each case runs in a fresh interpreter: the allocator's state is per process and a pin cannot be undone.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from optimum_pact.errors import OptionError
from optimum_pact.memory.allocator import _glibc
from trainer_callbacks import PactTrainingArguments

pytestmark = pytest.mark.skipif(_glibc() is None, reason="glibc's malloc only")

# After a 16 MiB tensor is freed, is a new 8 MiB tensor mapped (given back when freed) or taken from the heap?
PROBE = """
import ctypes, json, sys
import torch

class MallInfo2(ctypes.Structure):
    _fields_ = [(f, ctypes.c_size_t) for f in "arena ord smb hblks hblkhd usmb fsmb uord ford keep".split()]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
pinned = None
if sys.argv[1] == "pin":
    from optimum_pact import pin_mmap_threshold
    pinned = pin_mmap_threshold()
elif sys.argv[1] == "after_training":  # what `pact finetune` does once training is done
    from optimum_pact.commands.finetune import after_training
    from optimum_pact.memory import pinned_mmap_threshold
    after_training()
    pinned = pinned_mmap_threshold()
elif sys.argv[1].startswith("trainer"):
    from trainer_callbacks import PactTrainer, PactTrainingArguments
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1)
    pin = {"pact_mmap_threshold": 4 << 20} if sys.argv[1] == "trainer-pinned" else {}
    args = PactTrainingArguments(output_dir=sys.argv[2], max_steps=1, report_to=[], save_strategy="no",
                                 per_device_train_batch_size=1, use_cpu=True, **pin)
    ids = torch.randint(0, 64, (8,))
    data = [{"input_ids": ids, "labels": ids}]
    PactTrainer(LlamaForCausalLM(config), args, train_dataset=data).train()
big = torch.empty(16 << 20, dtype=torch.uint8)
del big  # glibc raises its threshold to this chunk's size unless it is pinned
before = libc.mallinfo2().hblkhd
small = torch.empty(8 << 20, dtype=torch.uint8)  # above the default pin (4 MiB)
print(json.dumps({"pinned": pinned, "mapped_growth": libc.mallinfo2().hblkhd - before}))
"""


def _probe(mode: str, tmp_path, env: dict | None = None) -> dict:
    environ = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"} | (env or {})
    out = subprocess.run(
        [sys.executable, "-c", PROBE, mode, str(tmp_path)], capture_output=True, text=True, env=environ, check=True
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_glibc_keeps_a_freed_large_tensor_in_its_heap_unless_the_threshold_is_pinned(tmp_path):
    assert _probe("none", tmp_path)["mapped_growth"] == 0  # the mechanism the pin is for: 8 MiB from the heap
    pinned = _probe("pin", tmp_path)
    assert pinned["pinned"] is True and pinned["mapped_growth"] >= 8 << 20


def test_the_environment_setting_wins(tmp_path):
    probe = _probe("pin", tmp_path, {"MALLOC_MMAP_THRESHOLD_": str(32 << 20)})
    assert probe["pinned"] is False and probe["mapped_growth"] == 0  # the user's 32 MiB threshold stands


def test_pact_trainer_pins_the_threshold_only_when_asked(tmp_path):
    assert _probe("trainer", tmp_path)["mapped_growth"] == 0  # glibc's own policy: page faults only where it faults
    assert _probe("trainer-pinned", tmp_path)["mapped_growth"] >= 8 << 20


def test_the_main_job_pins_the_threshold_for_what_follows_training(tmp_path):
    probe = _probe("after_training", tmp_path)  # the final scoring's tensors go back when freed
    assert probe["pinned"] == 4 << 20 and probe["mapped_growth"] >= 8 << 20
    probe = _probe("after_training", tmp_path, {"MALLOC_MMAP_THRESHOLD_": str(32 << 20)})
    assert probe["pinned"] == 32 << 20 and probe["mapped_growth"] == 0  # the user's setting stands
    probe = _probe("after_training", tmp_path, {"MALLOC_MMAP_THRESHOLD_": "4M"})  # not a number: no crash after
    assert probe["pinned"] is None  # training (the adapter is not saved yet), and the environment is left to glibc


# 96 MiB of 1 MiB tensors from the heap (after a 16 MiB free raised the threshold), written, freed, with a live
# tensor above them so glibc's automatic trim of the heap's top cannot return them: only malloc_trim does.
TRIM_PROBE = """
import json, sys
import torch

def rss():
    return next(int(l.split()[1]) << 10 for l in open("/proc/self/status") if l.startswith("VmRSS:"))

if sys.argv[1] == "function":
    from optimum_pact.memory import trim_heap
    step = trim_heap
else:
    from trainer_callbacks import PactTrainer, PactTrainingArguments
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1)
    args = PactTrainingArguments(output_dir=sys.argv[2], max_steps=1, report_to=[], save_strategy="no",
                                 per_device_train_batch_size=1, use_cpu=True, pact_trim_heap=sys.argv[1] == "on")
    ids = torch.randint(0, 64, (8,))
    trainer = PactTrainer(LlamaForCausalLM(config), args, train_dataset=[{"input_ids": ids, "labels": ids}])
    step = trainer.train
big = torch.empty(16 << 20, dtype=torch.uint8)
del big  # glibc raises its mmap threshold to 16 MiB: the 1 MiB tensors below come from its heap
held = [torch.ones(1 << 20, dtype=torch.uint8) for _ in range(97)]
top = held.pop()  # kept: the freed 96 MiB lie below it, where glibc's own trim of the heap's top does not reach
del held
before = rss()
step()
print(json.dumps({"released_mib": (before - rss()) / 2**20}))
"""


@pytest.mark.parametrize("mode", ["function", "on", "off"])
def test_the_heap_is_trimmed_after_each_step_by_default(mode, tmp_path):
    out = subprocess.run(
        [sys.executable, "-c", TRIM_PROBE, mode, str(tmp_path)], capture_output=True, text=True, check=True
    ).stdout
    released = json.loads(out.strip().splitlines()[-1])["released_mib"]
    if mode == "off":
        assert released < 48, released  # the freed 96 MiB stay resident in glibc's heap
    else:
        assert released > 64, released  # the step itself keeps a few MiB


@pytest.mark.parametrize("value", [-1, 64 << 20, 1.5, True, "128k"])
def test_a_bad_threshold_is_named_with_its_fix(value, tmp_path):
    with pytest.raises(OptionError, match=r"pact_mmap_threshold=.*from 0 to 33554432.*None leaves") as err:
        PactTrainingArguments(output_dir=str(tmp_path), pact_mmap_threshold=value, report_to=[])
    assert err.value.option == "pact_mmap_threshold"


def test_the_trimmer_trims_after_the_first_step_then_only_when_the_heap_grows():
    from optimum_pact.memory import HeapTrimmer, resident_bytes

    trimmer = HeapTrimmer(slack=32 << 20)
    trimmer()  # the first step: trims, and keeps what the step left resident
    assert trimmer.trims == 1 and trimmer.baseline == pytest.approx(resident_bytes(), abs=8 << 20)
    assert trimmer() is False and trimmer.trims == 1  # nothing grew: no trim, no page faults next step
    grown = torch.ones(64 << 20, dtype=torch.uint8)  # 64 MiB more resident than the first step left
    trimmer()
    assert trimmer.trims == 2
    del grown
