"""Memory savers: checkpointing + disk offload, subset softmax, logits masking, live-tensor accounting.

Reference path: the same model without savers (`model(input_ids, labels=labels).loss`, transformers' loss). Savers
that change no numbers are compared with atol=1e-6 on fp32 (they differ only by summation order: chunked matmuls,
a permuted logsumexp); observed differences are ~1e-8.
"""

import errno
import os

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_model
from peft import LoraConfig, get_peft_model
from torch.utils._python_dispatch import TorchDispatchMode

from optimum_pact.dataflow import FrozenLinear
from optimum_pact.memory import (
    LiveTensorTracker,
    MemorySavers,
    OffloadError,
    TokenNeighbours,
    fake_peak,
    map_frozen_weights,
    module_tensors,
    subset_cross_entropy,
)
from optimum_pact.memory import offload as offload_module
from optimum_pact.memory.checkpoint import ATTENTION_OPS
from optimum_pact.memory.subset_softmax import batch_negatives
from peft_ext import PactConfig

ATOL = 1e-6
VOCAB = 128  # tiny_model's vocabulary


def _model(arch="llama", kind="pact", **overrides):
    model = tiny_model(arch, **overrides)
    if kind == "pact":  # init_lora_weights=False: B != 0, so every adapter matrix gets a non-zero gradient
        model = get_peft_model(model, PactConfig(r=4, target_modules="all-linear", init_lora_weights=False))
    return model.train()


def _batch(seq=40, prompt=0, seed=1):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (2, seq), generator=gen)
    labels = ids.clone()
    labels[:, :prompt] = -100
    return ids, labels


def _loss_and_grads(model, ids, labels):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad and p.grad is not None}
    return loss.detach(), grads


def _assert_same(reference, got, atol=ATOL):
    (loss_ref, grads_ref), (loss, grads) = reference, got
    torch.testing.assert_close(loss, loss_ref, atol=atol, rtol=0)
    assert grads.keys() == grads_ref.keys() and grads_ref
    for name in grads_ref:
        torch.testing.assert_close(grads[name], grads_ref[name], atol=atol, rtol=0, msg=name)


# ---------------------------------------------------------------- checkpointing + offload
@pytest.mark.parametrize("kind", ["pact", "plain"])
def test_offload_and_recompute_match_plain_gradients(arch, kind, tmp_path):
    model = _model(arch, kind)
    ids, labels = _batch()
    reference = _loss_and_grads(model, ids, labels)
    blocks = len(model.get_base_model().model.layers) if kind == "pact" else len(model.model.layers)
    model.zero_grad(set_to_none=True)
    # mlp_chunk_tokens=16: the MLP is recomputed in 5 chunks; cache_mib: attention cached (selective checkpointing);
    # mask_logits=False: the loss is transformers' own
    options = dict(mlp_chunk_tokens=16, cache_mib=64.0, subset_k=None, mask_logits=False)
    with MemorySavers(model, offload_dir=tmp_path, **options) as savers:
        offloader = savers.offloader
        loss = model(input_ids=ids, labels=labels).loss
        offloader._wait_writes()
        assert len(offloader.live_files()) == blocks  # one block input per block on disk between forward and backward
        loss.backward()
        got = (loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        assert offloader.live_files() == []  # each file deleted once read back
        assert offloader.bytes_written == blocks * ids.numel() * 64 * 4  # [2, 40, hidden 64] fp32 per block
    assert not offloader.folder.exists()
    _assert_same(reference, got)
    assert all("forward" not in vars(m) for m in model.modules())  # close() restored every forward


def test_offloaded_block_inputs_leave_memory(tmp_path):
    model = _model(num_hidden_layers=4)
    ids, labels = _batch()
    live = {}
    for offload in (False, True):
        with MemorySavers(model, offload=offload, offload_dir=tmp_path) as savers:
            with LiveTensorTracker(module_tensors(model)) as tracker:
                loss = model(input_ids=ids, labels=labels).loss
                if offload:
                    savers.offloader._wait_writes()
                live[offload] = tracker.live_bytes  # between forward and backward
            loss.backward()
    assert live[False] - live[True] == 4 * ids.numel() * 64 * 4  # the 4 block inputs [2, 40, 64] fp32 are on disk


def test_attention_output_is_cached_not_recomputed(tmp_path):
    class CountAttention(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            CountAttention.calls += func.overloadpacket in ATTENTION_OPS
            return func(*args, **(kwargs or {}))

    model = _model()
    ids, labels = _batch()
    reference = _loss_and_grads(model, ids, labels)
    model.zero_grad(set_to_none=True)
    for cache_mib, recomputed in ((64.0, 0), (0.0, 2)):
        with MemorySavers(model, offload_dir=tmp_path, cache_mib=cache_mib):
            loss = model(input_ids=ids, labels=labels).loss
            CountAttention.calls = 0
            with CountAttention():
                loss.backward()
            assert CountAttention.calls == recomputed  # forward attention ops run again in backward only if uncached
            got = (loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
            model.zero_grad(set_to_none=True)
        _assert_same(reference, got)


@pytest.mark.parametrize("cache_mib", [64.0, 0.0])
def test_chunked_mlp_is_recomputed_once_per_chunk(tmp_path, cache_mib):
    model = _model()
    ids, labels = _batch()  # 2 x 40 = 80 tokens: 5 chunks of 16
    calls = []  # a pre-hook: recomputation stops (early) inside the layer, before a forward hook would run
    for block in model.get_base_model().model.layers:
        frozen = block.mlp.down_proj.get_base_layer()
        assert isinstance(frozen, FrozenLinear)  # so each call below is a frozen NVFP4 product; in backward the third
        frozen.register_forward_pre_hook(lambda m, i: calls.append(i[0].shape[0]))
    with MemorySavers(model, offload_dir=tmp_path, cache_mib=cache_mib, mlp_chunk_tokens=16):
        loss = model(input_ids=ids, labels=labels).loss
        assert calls == [16] * 10  # forward: 5 chunks x 2 blocks
        calls.clear()
        loss.backward()
        assert calls == [16] * 10  # backward: each chunk once; the block's replay skips the MLP


def test_offload_files_removed_after_exception_in_backward(tmp_path):
    model = _model(num_hidden_layers=4)  # backward fails in block 3; block 2's input is prefetched, 0 and 1 wait
    ids, labels = _batch()
    last_block = model.get_base_model().model.layers[-1]
    savers = MemorySavers(model, offload_dir=tmp_path)
    folder = savers.offloader.folder

    def fail(grad):
        raise RuntimeError("injected failure in backward")

    handle = last_block.self_attn.q_proj.lora_A["default"].weight.register_hook(fail)
    loss = model(input_ids=ids, labels=labels).loss
    with pytest.raises(RuntimeError, match="injected failure"):
        loss.backward()
    handle.remove()
    assert len(savers.offloader.live_files()) == 2  # blocks 0 and 1: their inputs were never read back ...
    del loss
    loss = model(input_ids=ids, labels=labels).loss  # ... and go when the next step's forward starts
    savers.offloader._wait_writes()
    assert [p.name for p in savers.offloader.live_files()] == [f"{i:06d}.bin" for i in range(5, 9)]
    loss.backward()
    assert savers.offloader.live_files() == []
    model(input_ids=ids, labels=labels)  # a forward whose backward never runs: its files go at close()
    savers.close()
    assert not folder.exists()


def test_offload_dir_not_writable_is_a_clear_error(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    bad = blocker / "offload"
    with pytest.raises(OffloadError, match="not writable") as info:
        MemorySavers(_model(), offload_dir=bad)
    assert str(bad) in str(info.value) and "offload_dir" in str(info.value)
    if os.geteuid() != 0:  # root ignores permission bits
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(OffloadError, match="not writable"):
            MemorySavers(_model(), offload_dir=locked)


def test_out_of_space_mid_step_fails_cleanly(tmp_path, monkeypatch):
    model = _model()
    ids, labels = _batch()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    savers = MemorySavers(model, offload_dir=tmp_path)
    model(input_ids=ids, labels=labels).loss.backward()  # one good step: the optimizer has state
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    before = [p.detach().clone() for p in params]
    state = {k: v.clone() for s in optimizer.state.values() for k, v in s.items()}

    writes = []
    real_write = offload_module._write_bytes

    def fills_up(path, data):  # the disk fills up on the step's second write
        writes.append(path)
        if len(writes) == 2:
            with open(path, "wb") as f:
                f.write(bytes(data)[:100])  # a partial file, as a real ENOSPC leaves behind
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_write(path, data)

    monkeypatch.setattr(offload_module, "_write_bytes", fills_up)
    with pytest.raises(OffloadError, match="ran out of space") as info:
        model(input_ids=ids, labels=labels).loss.backward()
        optimizer.step()
    assert str(tmp_path) in str(info.value)
    assert savers.offloader.live_files() == []  # nothing left behind, the partial file included
    assert all(p.grad is None for p in params)  # no gradient was accumulated
    assert all(torch.equal(a, b) for a, b in zip(before, params))
    after = {k: v for s in optimizer.state.values() for k, v in s.items()}
    assert all(torch.equal(state[k], after[k]) for k in state)
    monkeypatch.setattr(offload_module, "_write_bytes", real_write)
    model(input_ids=ids, labels=labels).loss.backward()  # space is back: training continues
    assert all(p.grad is not None for p in params)
    savers.close()


def test_mapped_weights_change_nothing_and_leave_no_file(tmp_path):
    model = _model("qwen2", tie_word_embeddings=True)
    ids, labels = _batch()
    reference = _loss_and_grads(model, ids, labels)
    with MemorySavers(model, offload_dir=tmp_path, map_weights=True, subset_k=VOCAB) as savers:
        assert savers.mapped_weights and list(tmp_path.glob("pact-weights-*")) == []  # unlinked once mapped
        maps = open("/proc/self/maps").read()
        assert "pact-weights-" in maps and "(deleted)" in maps  # still file-backed
        base = model.get_base_model()
        assert base.lm_head.weight is base.model.embed_tokens.weight  # tied weights stay tied
        _assert_same(reference, _loss_and_grads(model, ids, labels))
        with LiveTensorTracker(module_tensors(model), mapped=savers.mapped_weights) as tracker:
            mapped = sum(t.numel() * t.element_size() for t in savers.mapped_weights)
            assert tracker.mapped_bytes == mapped and tracker.live_bytes < sum(
                t.numel() * t.element_size() for t in module_tensors(model)
            )


def test_mapping_weights_hands_back_the_pages_of_a_base_read_mapped(tmp_path):
    """A base read memory-mapped (the packed cache) and then mapped again: the pages it had read must not stay
    resident beside the copy's (at 1.5B the `exact` savers counted both, 1.8 GiB more at the end of a run)."""
    from optimum_pact.pages import byte_range, resident_bytes

    torch.save({"weight": torch.randn(1024, 1024)}, tmp_path / "base.pt")  # 4 MiB
    original = torch.load(tmp_path / "base.pt", mmap=True, weights_only=True)["weight"]
    layer = torch.nn.Linear(1024, 1024, bias=False)
    layer.weight = torch.nn.Parameter(original, requires_grad=False)
    expected = float(original.sum())  # read: its pages are resident
    start, end = byte_range(original)
    assert resident_bytes(start, end) >= 4 << 20
    map_frozen_weights(layer, folder=tmp_path / "mapped")
    assert resident_bytes(start, end) == 0  # handed back (clean file pages: the bytes stay readable)
    assert layer.weight.data_ptr() != original.data_ptr() and float(layer.weight.sum()) == expected


def _frozen_stack(second: str = "nvfp4"):
    """Two FrozenLinears, NVFP4 (64 -> 32) then `second` (32 -> 16; "fp16": kept 16-bit by a precision plan), and
    their output on a fixed input."""
    torch.manual_seed(0)
    first, last = torch.nn.Linear(64, 32), torch.nn.Linear(32, 16)
    stack = torch.nn.Sequential(FrozenLinear.from_linear(first), FrozenLinear.from_linear(last, precision=second))
    return stack, stack(torch.ones(3, 64)).detach()


def _corrupting_save(monkeypatch, edit):
    """Make torch.save write what `edit(obj, path)` leaves of the weights file map_frozen_weights writes."""
    real_save = torch.save

    def save(obj, path, *args, **kwargs):
        obj = dict(obj)
        edit(obj, path, lambda o: real_save(o, path, *args, **kwargs))

    monkeypatch.setattr(torch, "save", save)


def _key_of(obj, dtype, shape):
    (key,) = [k for k, t in obj.items() if t.dtype == dtype and tuple(t.shape) == shape]
    return key


def test_mapped_weights_keep_the_products_of_nvfp4_and_fp16_layers(tmp_path):
    stack, expected = _frozen_stack("fp16")
    mapped = map_frozen_weights(stack, folder=tmp_path)
    assert set(mapped["names"]) == {"0.weight", "0.weight_scale", "0.weight_scale_2", "0.bias", "1.weight", "1.bias"}
    torch.testing.assert_close(stack(torch.ones(3, 64)), expected, atol=0, rtol=0)
    assert list(tmp_path.iterdir()) == []


def test_truncated_mapped_weights_file_is_refused_naming_it(tmp_path, monkeypatch):
    def truncate(obj, path, save):
        save(obj)
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)

    _corrupting_save(monkeypatch, truncate)
    stack, _ = _frozen_stack()
    with pytest.raises(ValueError) as info:
        map_frozen_weights(stack, folder=tmp_path)
    message = str(info.value)
    assert "map_frozen_weights" in message and str(tmp_path / "pact-weights-") in message, message
    assert "truncated or corrupt" in message and "free space" in message, message
    assert list(tmp_path.iterdir()) == []  # not left behind


@pytest.mark.parametrize(
    ("edit", "problem"),
    [
        (lambda obj, key: obj.pop(key), "0.weight_scale: missing from the weights file"),
        (lambda obj, key: obj.update({key: obj[key].to(torch.float16)}), "0.weight_scale: dtype torch.float16"),
        (lambda obj, key: obj.update({key: obj[key][:, :2].contiguous()}), "0.weight_scale: shape [32, 2]"),
    ],
)
def test_mapped_weights_file_with_a_missing_or_mismatched_tensor_is_refused_naming_it(
    tmp_path, monkeypatch, edit, problem
):
    def corrupt(obj, path, save):
        edit(obj, _key_of(obj, torch.float8_e4m3fn, (32, 4)))
        save(obj)

    _corrupting_save(monkeypatch, corrupt)
    stack, expected = _frozen_stack()
    with pytest.raises(ValueError) as info:
        map_frozen_weights(stack, folder=tmp_path)
    assert problem in str(info.value), str(info.value)
    assert list(tmp_path.iterdir()) == []
    torch.testing.assert_close(stack(torch.ones(3, 64)), expected, atol=0, rtol=0)  # the model was left as it was


def test_stale_offload_folder_of_a_dead_process_is_removed(tmp_path):
    stale = tmp_path / "pact-offload-999999999-abc"
    stale.mkdir()
    (stale / "000001.bin").write_bytes(b"x")
    with MemorySavers(_model(), offload_dir=tmp_path):
        assert not stale.exists()


# ---------------------------------------------------------------- subset softmax
def test_subset_cross_entropy_with_k_vocab_equals_full_cross_entropy():
    torch.manual_seed(0)
    weight, hidden = torch.randn(VOCAB, 32) / 4, torch.randn(50, 32, requires_grad=True)  # logits ~ N(0, 2)
    targets = torch.randint(0, VOCAB, (50,))
    full = F.cross_entropy(hidden @ weight.t(), targets, reduction="none")
    (grad_full,) = torch.autograd.grad(full.sum(), hidden)
    subset = subset_cross_entropy(hidden, weight, targets, TokenNeighbours(weight, k=VOCAB))
    (grad_subset,) = torch.autograd.grad(subset.sum(), hidden)
    torch.testing.assert_close(subset, full, atol=ATOL, rtol=0)
    torch.testing.assert_close(grad_subset, grad_full, atol=ATOL, rtol=0)


def test_subset_softmax_is_a_lower_bound_whose_gradient_lives_on_the_subset():
    torch.manual_seed(0)
    weight, hidden = torch.randn(VOCAB, 32) / 4, torch.randn(20, 32)
    targets = torch.randint(0, VOCAB, (20,))
    neighbours = TokenNeighbours(weight, k=10, samples=0)  # no far sample: the subset loss alone
    subsets = neighbours(targets).long()
    assert torch.equal(subsets[:, 0], targets)
    full = F.cross_entropy(hidden @ weight.t(), targets, reduction="none")
    assert subset_cross_entropy(hidden[:0], weight, targets[:0], neighbours).shape == (0,)  # no labelled token
    alone = torch.tensor([], dtype=torch.long)  # the neighbours alone, without the batch's targets
    approx = subset_cross_entropy(hidden.requires_grad_(), weight, targets, neighbours, negatives=alone)
    assert (approx <= full + ATOL).all()  # logsumexp over a subset of the terms
    (grad,) = torch.autograd.grad(approx.sum(), hidden)
    # d loss / d logits = softmax over the subset - onehot(target), zero outside the subset
    z = torch.gather(hidden @ weight.t(), 1, subsets)
    dz = torch.zeros(20, VOCAB).scatter_(1, subsets, z.softmax(-1) - F.one_hot(torch.zeros(20).long(), 10))
    torch.testing.assert_close(grad, dz @ weight, atol=ATOL, rtol=0)


def test_subset_softmax_holds_the_batch_targets_once_each():
    torch.manual_seed(1)
    weight, hidden = torch.randn(VOCAB, 32) / 4, torch.randn(30, 32, requires_grad=True)
    targets = torch.randint(0, 6, (30,))  # few distinct answers (fewer than k), as in a classification fine-tune
    neighbours = TokenNeighbours(weight, k=8, samples=0)
    losses = subset_cross_entropy(hidden, weight, targets, neighbours, chunk_tokens=7)
    (grad,) = torch.autograd.grad(losses.sum(), hidden)
    # reference: an explicit set per row, each token once: target + its 7 nearest + every target of the batch
    logits = hidden.detach() @ weight.t()
    mask = torch.full((30, VOCAB), float("-inf"))
    for row, near in enumerate(neighbours(targets).long()):
        mask[row, near] = 0.0
        mask[row, targets.unique()] = 0.0
    reference = F.cross_entropy(logits + mask, targets, reduction="none")
    dz = (logits + mask).softmax(-1) - F.one_hot(targets, VOCAB)
    torch.testing.assert_close(losses, reference, atol=ATOL, rtol=0)
    torch.testing.assert_close(grad, dz @ weight, atol=ATOL, rtol=0)
    assert (dz[:, targets.unique()] != 0).all()  # every other answer is pushed down at every position
    assert batch_negatives(torch.tensor([5, 5, 5, 3, 3, 7]), 2).sort().values.tolist() == [3, 5]  # most frequent


def test_far_sample_estimates_the_full_softmax_normalizer_and_gradient():
    torch.manual_seed(2)
    weight, hidden = torch.randn(VOCAB, 32) / 4, torch.randn(6, 32)  # logits ~ N(0, 2)
    targets = torch.tensor([3, 3, 50, 50, 90, 3])
    full = F.cross_entropy(hidden @ weight.t(), targets, reduction="none")
    (grad_full,) = torch.autograd.grad(
        F.cross_entropy(hidden.requires_grad_() @ weight.t(), targets, reduction="sum"), hidden
    )
    neighbours = TokenNeighbours(weight, k=4, samples=16, seed=0)
    explicit = set(neighbours(targets).flatten().tolist())
    normalizers, grads = [], []
    for _ in range(3000):  # a fresh far sample per call
        h = hidden.detach().requires_grad_()
        loss = subset_cross_entropy(h, weight, targets, neighbours)
        (g,) = torch.autograd.grad(loss.sum(), h)
        normalizers.append(loss.detach().exp())  # e^{loss} = estimated normalizer / e^{z_y}: unbiased
        grads.append(g)
    drawn = torch.stack(normalizers)
    assert len(explicit) < VOCAB / 8  # most of the vocabulary is far: only the sample sees it
    torch.testing.assert_close(drawn.mean(0), full.exp(), rtol=0.03, atol=0)
    assert (drawn.std(0) > 0).all()  # really sampled
    mean_grad = torch.stack(grads).mean(0)
    assert (mean_grad - grad_full).norm() < 0.1 * grad_full.norm()
    alone = subset_cross_entropy(hidden.detach(), weight, targets, TokenNeighbours(weight, k=4, samples=0))
    assert (alone < full).all() and (full - alone).mean() > 0.5  # without the sample: far mass missing


def test_neighbours_chunked_equal_brute_force_cosine_top_k():
    torch.manual_seed(0)
    weight = torch.randn(VOCAB, 16)
    neighbours = TokenNeighbours(weight, k=7, query_chunk=5, vocab_chunk=16)  # never a [vocab, vocab] matrix
    ids = torch.tensor([3, 0, 127, 3, 64])
    unit = F.normalize(weight, dim=-1)
    sims = unit @ unit.t()
    sims.fill_diagonal_(float("inf"))
    expected = sims[ids].topk(7, dim=1).indices
    assert torch.equal(neighbours(ids).long(), expected)
    assert len(neighbours) == 4  # each id's row computed once


def test_subset_softmax_with_k_vocab_equals_full_loss_on_a_model(arch, tmp_path):
    model = _model(arch)
    ids, labels = _batch(prompt=12)
    reference = _loss_and_grads(model, ids, labels)
    with MemorySavers(model, offload_dir=tmp_path, subset_k=VOCAB, mlp_chunk_tokens=16):
        _assert_same(reference, _loss_and_grads(model, ids, labels))


def test_subset_k_larger_than_vocabulary_is_a_clear_error():
    with pytest.raises(ValueError) as info:
        MemorySavers(_model(), subset_k=1000)
    message = str(info.value)
    assert "k=1000" in message and f"({VOCAB} tokens)" in message and f"k <= {VOCAB}" in message


# ---------------------------------------------------------------- logits masking
@pytest.mark.parametrize("prompt", [0, 25])
def test_logits_masking_changes_no_loss_or_gradient(arch, prompt):
    model = _model(arch)
    ids, labels = _batch(prompt=prompt)  # prompt=0: every position labelled
    reference = _loss_and_grads(model, ids, labels)
    heads = []
    model.get_base_model().lm_head.register_forward_hook(lambda m, i, o: heads.append(i[0].shape))
    with MemorySavers(model, checkpoint=False, offload=False, mask_logits=True):
        _assert_same(reference, _loss_and_grads(model, ids, labels))
        assert heads == []  # transformers' lm_head forward (all positions, all tokens) never ran
        model.eval()
        with torch.no_grad():
            assert model(input_ids=ids).logits.shape == (2, 40, VOCAB)  # eval runs the model unchanged


# ---------------------------------------------------------------- accounting
def test_live_tensor_tracker_counts_storages_until_freed():
    with LiveTensorTracker() as tracker:
        a = torch.ones(1000)  # 4000 bytes
        b = a * 2
        view = b[:10]
        del b  # the view keeps b's storage alive
        assert tracker.live_bytes == 8000
        del view
        c = torch.ones(250)
        assert tracker.live_bytes == 5000 and tracker.peak_bytes == 8000
    del a, c


def test_fake_accounting_equals_real_measurement():
    def build():  # the baseline: peft LoRA on fp32 weights (PACT arms quantize real weights; they run for real)
        torch.manual_seed(0)
        return get_peft_model(tiny_model("qwen2"), LoraConfig(r=4, target_modules="all-linear")).train()

    def step(model):
        ids = torch.randint(0, VOCAB, (1, 64))
        model(input_ids=ids, labels=ids).loss.backward()

    model = build()
    with LiveTensorTracker(module_tensors(model)) as tracker:
        weights = tracker.live_bytes
        step(model)
    fake = fake_peak(build, step)
    assert fake["weights_bytes"] == weights
    assert fake["peak_bytes"] == tracker.peak_bytes
