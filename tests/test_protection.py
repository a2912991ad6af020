"""AQLoRA protection: exact 4-bit error metrics, deterministic ranking, clear errors, a backward pass that stops."""

import contextlib
import importlib.util
import io
import json
import sys
import tarfile
from pathlib import Path

import pytest
import torch
from conftest import tiny_model
from peft import LoraConfig, get_peft_model
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import peft_ext.ranking as ranking
from optimum_pact.backends import get_backend
from optimum_pact.dataflow import FrozenLinear
from optimum_pact.nvfp4 import dequantize_reference, quantize
from peft_ext import PactConfig
from peft_ext.backward_stop import stop_backward_below
from peft_ext.blocks import (
    block_index,
    decoder_linears,
    default_top_blocks,
    lowest_trainable_block,
    num_blocks,
    quantize_unadapted,
    speed_targets,
)
from peft_ext.ranking import (
    NF4_VALUES,
    check_protect_fraction,
    check_rank_by,
    choose_protected,
    nf4_dequantized,
    nvfp4_dequantized,
    rank_layers,
    reconstruction_error,
)

SHAPES = [(64, 128), (96, 208), (7, 48), (33, 16)]  # 208 and 48 put NF4 blocks across rows; 7 * 48 leaves a part


def _weight(shape, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * 0.02
    w[0, :3] = 0.0  # exact zeros
    w[-1, -1] = 0.5  # an outlier
    return w.to(dtype)


# ---------------------------------------------------------------------------------------------------- numerics


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_nf4_is_bit_exact_with_bitsandbytes(shape, dtype):
    # bitsandbytes.functional only (no Linear4bit): FACTS.md's eval-repack bug lives in Linear4bit, not here
    bnb = pytest.importorskip("bitsandbytes.functional")
    w = _weight(shape, dtype=dtype)
    packed, state = bnb.quantize_4bit(w, blocksize=64, quant_type="nf4")
    # bnb's own codes (first element in the high nibble) and fp32 absmax, through the published codebook
    codes = torch.stack((packed.flatten() >> 4, packed.flatten() & 15), dim=-1).flatten()[: w.numel()].long()
    absmax = state.absmax.repeat_interleave(64)[: w.numel()]
    from_bnb_codes = (torch.tensor(NF4_VALUES)[codes] * absmax).reshape(shape)
    got = nf4_dequantized(w)
    assert torch.equal(got, from_bnb_codes), f"{shape} {dtype}: max |diff| {(got - from_bnb_codes).abs().max()}"
    if shape[1] % 64 == 0:
        # bnb's native CPU dequantizer agrees too (in w's dtype: it rounds code * absmax at the end). It does NOT
        # when 64-blocks straddle rows (in_features % 64 != 0): bnb 0.50.2's CPU kernel then returns a wrong weight
        # (relative error 0.3-0.7 instead of ~0.1), while its pure-torch dequantizer matches the codes above.
        assert torch.equal(got.to(dtype), bnb.dequantize_4bit(packed, state))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_nvfp4_is_bit_exact_with_the_reference(shape, dtype):
    w = _weight(shape, dtype=dtype)
    q = quantize(w)
    expected = dequantize_reference(q.qdata, q.scale, q.scale_2)
    assert torch.equal(nvfp4_dequantized(w), expected)


def test_fast_nf4_rounding_is_exact_at_every_tie():
    # bitsandbytes rounds with bucketize over the codebook midpoints (a tie goes to the lower code)
    code = torch.tensor(NF4_VALUES)
    mids = (code[:-1] + code[1:]) / 2
    up, down = torch.full_like(mids, 2.0), torch.full_like(mids, -2.0)
    x = torch.cat([mids, torch.nextafter(mids, up), torch.nextafter(mids, down), code, torch.rand(100_000) * 2 - 1])
    assert torch.equal(ranking._NF4.round(x), code[torch.bucketize(x, mids)])


@pytest.mark.parametrize("rank_by", ["nf4", "nvfp4"])
def test_chunked_error_equals_the_whole_tensor_formula(monkeypatch, rank_by):
    w = _weight((96, 208))
    w[-1, 0] = 2.0  # the tensor's amax sits in the last chunk: NVFP4's per-tensor scale must still be global
    deq = nf4_dequantized(w) if rank_by == "nf4" else nvfp4_dequantized(w)
    expected = ((w.double() - deq.double()).norm() / w.double().norm()).item()
    monkeypatch.setattr(ranking, "CHUNK_ELEMENTS", 3 * 208)  # many chunks
    assert reconstruction_error(w, rank_by) == pytest.approx(expected, rel=1e-12)


def test_error_is_zero_on_the_grid_and_typical_for_gaussian_weights():
    nf4 = torch.tensor(NF4_VALUES).repeat(8, 4) * torch.tensor([[0.5], [2.0]] * 4)  # every 64-block has absmax 1 x s
    assert reconstruction_error(nf4, "nf4") == 0.0
    # E2M1 x exact E4M3 block scales (448, 64) x scale_2 = amax / 2688 = 2**-12: every value representable
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, -3.0, 4.0, 6.0]).repeat(2, 4) * torch.tensor([[448.0], [64.0]])
    grid = grid * 2.0**-12
    assert reconstruction_error(grid, "nvfp4") == 0.0
    assert reconstruction_error(torch.zeros(4, 64), "nf4") == reconstruction_error(torch.zeros(4, 64), "nvfp4") == 0.0
    gaussian = torch.randn(256, 512, generator=torch.Generator().manual_seed(0))
    for rank_by in ("nf4", "nvfp4"):  # 4-bit formats lose ~9-10% of a Gaussian weight's norm
        assert 0.07 < reconstruction_error(gaussian, rank_by) < 0.12, rank_by


def test_bad_rank_by_and_shapes_are_refused():
    with pytest.raises(ValueError, match="rank_by='int4'.*nf4, nvfp4"):
        reconstruction_error(torch.randn(4, 16), "int4")
    with pytest.raises(ValueError, match="multiple of 16"):
        reconstruction_error(torch.randn(4, 24), "nvfp4")
    assert reconstruction_error(torch.randn(4, 24), "nf4") > 0  # NF4 blocks the flat tensor: any shape works


# --------------------------------------------------------------------------------------------- model structure


def test_decoder_linears_are_the_same_before_and_after_get_peft_model():
    model = tiny_model("llama")
    names = list(decoder_linears(model))
    assert len(names) == 14 and names[0] == "model.layers.0.self_attn.q_proj" and "lm_head" not in names
    base = dict(decoder_linears(model))
    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "down_proj"]))
    wrapped = decoder_linears(peft_model)
    assert list(wrapped) == names
    assert all(wrapped[name] is base[name] for name in names)  # a LoRA layer counts as its base_layer
    assert [block_index(n) for n in names] == [0] * 7 + [1] * 7 and block_index("lm_head") is None
    assert num_blocks(peft_model) == 2


def test_a_model_without_understood_linears_is_a_clear_error():
    with pytest.raises(ValueError, match="no linear layer the AQLoRA ranking understands.*torch.nn.Linear"):
        decoder_linears(torch.nn.Sequential(torch.nn.Embedding(8, 4)))
    quantized = get_peft_model(tiny_model("llama"), PactConfig(r=4, target_modules="all-linear"))
    with pytest.raises(ValueError, match="Found only FrozenLinear.*before get_peft_model"):
        rank_layers(quantized)
    assert num_blocks(quantized) == 2  # the block list is found by structure, not by linear type


# ------------------------------------------------------------------------------------------ ranking, protection


def _model_with_planted_layers():
    """Tiny Llama (Gaussian init) with one layer each format handles worst, and two identical layers (a tie)."""
    model = tiny_model("llama", num_hidden_layers=4)
    layers = decoder_linears(model)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        up = layers["model.layers.2.mlp.up_proj"].weight
        up.copy_(torch.randn(up.shape, generator=g) ** 3 * 0.01)  # heavy tails: NF4's worst, NVFP4's easy case
        # every block of 16: a largest magnitude 1 and fifteen 7/16. Each block holds the tensor's amax, so every
        # scale rule keeps e4m3's largest scale (the largest maps to 6): the fifteen land at 2.625, 0.375 from 3.
        # Bad for NVFP4; NF4 holds 0.4407
        v = layers["model.layers.0.self_attn.v_proj"].weight
        magnitude = torch.full(v.shape, 7 / 16)
        magnitude[:, ::16] = 1.0
        v.copy_(torch.randn(v.shape, generator=g).sign() * magnitude * 0.02)
        layers["model.layers.3.self_attn.o_proj"].weight.copy_(layers["model.layers.3.self_attn.q_proj"].weight)
    return model


@pytest.mark.parametrize(
    "rank_by, worst, easy",
    [
        ("nf4", "model.layers.2.mlp.up_proj", None),
        ("nvfp4", "model.layers.0.self_attn.v_proj", "model.layers.2.mlp.up_proj"),
    ],
)
def test_ranking_finds_the_worst_layer_breaks_ties_by_name_and_needs_only_the_weights(rank_by, worst, easy):
    model = _model_with_planted_layers()
    ranking = rank_layers(model, rank_by)
    names = [name for name, _ in ranking]
    errors = [e for _, e in ranking]
    assert names[0] == worst and errors[0] > errors[1] + 0.01, ranking[:3]
    if easy:  # the formats disagree: heavy tails suit E2M1's log-like grid, bimodal weights suit NF4
        assert names.index(easy) > len(names) // 2
    assert errors == sorted(errors, reverse=True) and len(ranking) == 28
    tie = names.index("model.layers.3.self_attn.o_proj")  # identical weights -> identical errors -> name order
    assert names[tie + 1] == "model.layers.3.self_attn.q_proj" and errors[tie] == errors[tie + 1]

    fresh = tiny_model("llama", seed=123, num_hidden_layers=4)  # other init, same weights loaded
    fresh.load_state_dict(model.state_dict())
    wrapped = get_peft_model(fresh, LoraConfig(r=4, target_modules="all-linear"))
    assert rank_layers(wrapped, rank_by) == ranking
    assert choose_protected(wrapped, 0.1, rank_by) == choose_protected(ranking, 0.1) == names[:3]  # 2.8 -> 3


def test_protect_fraction_counts_and_errors():
    ranking = [(f"model.layers.{i}.mlp.up_proj", 1.0) for i in range(10)]
    assert choose_protected(ranking, 0.0) == []
    assert len(choose_protected(ranking, 1.0)) == 10
    assert len(choose_protected(ranking, 0.25)) == 3  # 2.5 rounds half up
    assert choose_protected(ranking, 0.2) == ["model.layers.0.mlp.up_proj", "model.layers.1.mlp.up_proj"]
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match=rf"protect_fraction={bad}.*valid range \[0, 1\]"):
            choose_protected(ranking, bad)
    with pytest.raises(ValueError, match="protect_fraction=2"):
        choose_protected(tiny_model("llama"), 2)  # refused before any ranking work
    with pytest.raises(ValueError, match=r"PactConfig.protect_fraction=-1 is outside the valid range \[0, 1\]"):
        check_protect_fraction(-1, "PactConfig.protect_fraction")  # for PactConfig.__post_init__
    with pytest.raises(TypeError, match="protect_fraction must be a number"):
        check_protect_fraction("0.2")
    with pytest.raises(ValueError, match="PactConfig.rank_by='fp4'"):
        check_rank_by("fp4", "PactConfig.rank_by")


# ----------------------------------------------------------------------------------------------- speed setting


def test_speed_targets_take_the_top_blocks():
    model = tiny_model("llama", num_hidden_layers=4)
    assert {block_index(n) for n in speed_targets(model, 1)} == {3} and len(speed_targets(model, 1)) == 7
    assert {block_index(n) for n in speed_targets(model)} == set(range(4 - default_top_blocks(4), 4))
    assert default_top_blocks(30) == 15 and default_top_blocks(1) == 1
    for bad in (0, 5, True, 2.0):
        with pytest.raises(ValueError, match=rf"adapt_top_blocks={bad!r}.*has 4 decoder blocks.*from 1 to 4"):
            speed_targets(model, bad)


class _LowerBlockTracer(TorchFunctionMode):
    """Records the autograd node of every tensor produced while a block below `lowest` runs its forward."""

    def __init__(self, model, lowest):
        super().__init__()
        self.current, self.nodes, self.forward_calls = [], [], 0
        blocks = model.base_model.model.model.layers
        for i, block in enumerate(blocks[:lowest]):
            block.register_forward_pre_hook(lambda m, a, i=i: self._enter(i))
            block.register_forward_hook(lambda m, a, o: self._leave())
            for linear in block.modules():
                if isinstance(linear, torch.nn.Linear):
                    linear.register_forward_hook(self._count)

    def _enter(self, i):
        self.current.append(i)  # returns None: the inputs stay as they are

    def _leave(self):
        self.current.pop()  # returns None: a forward hook's result would replace the block's output

    def _count(self, module, args, output):
        self.forward_calls += 1
        self._record(output)

    def _record(self, out):
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.grad_fn is not None:
                self.nodes.append(t.grad_fn)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.current:
            self._record(out)
        return out


class _MatmulCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func.__name__.split(".")[0] in ("mm", "addmm", "bmm", "matmul")
        return func(*args, **(kwargs or {}))


def _backward_below(checkpointing, stop, stop_first=True):
    """One step of LoRA on the top 2 of 4 blocks; what ran in the backward pass below block 2."""
    model = tiny_model("llama", num_hidden_layers=4)
    model = get_peft_model(model, LoraConfig(r=4, target_modules=speed_targets(model, 2), init_lora_weights=False))
    lowest = lowest_trainable_block(model)
    assert lowest == 2

    def enable_checkpointing():
        if checkpointing:  # like the Trainer: this also installs the input-embedding requires_grad hook
            model.activation_checkpointing_enable({"use_reentrant": checkpointing == "reentrant"})

    if stop and stop_first:
        stop_backward_below(model, lowest)
        enable_checkpointing()
    else:
        enable_checkpointing()
        if stop:
            stop_backward_below(model, lowest)
    model.train()
    tracer = _LowerBlockTracer(model, lowest)
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    with tracer, warnings_ignored():
        loss = model(input_ids=ids, labels=ids).loss
    forward_calls, executed = tracer.forward_calls, []
    for node in tracer.nodes:
        node.register_prehook(lambda grad_outputs, node=node: executed.append(node.name()))
    with _MatmulCounter() as matmuls, warnings_ignored():
        loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return {
        "executed": executed,
        "recomputed": tracer.forward_calls - forward_calls,
        "graph_nodes_below": len(tracer.nodes),
        "matmuls": matmuls.count,
        "grads": grads,
    }


def warnings_ignored():
    import warnings

    ctx = contextlib.ExitStack()
    ctx.enter_context(warnings.catch_warnings())
    warnings.simplefilter("ignore")  # reentrant checkpoint warns about inputs without requires_grad
    return ctx


@pytest.mark.parametrize("checkpointing", [None, "non-reentrant", "reentrant"])
def test_no_backward_op_runs_below_the_lowest_adapted_block(checkpointing):
    control = _backward_below(checkpointing, stop=False)
    if checkpointing:  # the control really pulls the backward pass down to the embeddings
        assert control["executed"], "control: expected backward nodes in blocks 0-1"
    for stop_first in (True, False):  # before or after checkpointing (and its embedding hook) is enabled
        run = _backward_below(checkpointing, stop=True, stop_first=stop_first)
        assert run["executed"] == [] and run["recomputed"] == 0, (stop_first, run["executed"][:5])
        assert run["graph_nodes_below"] == 0  # blocks 0-1 do not even build an autograd graph
        assert run["grads"].keys() == control["grads"].keys() and len(run["grads"]) == 2 * 7 * 2
        for name, grad in run["grads"].items():  # adapters of blocks 2-3 get the same, non-zero gradients
            assert grad.abs().sum() > 0, name
            torch.testing.assert_close(grad, control["grads"][name], rtol=1e-5, atol=1e-7)
        if checkpointing:
            assert run["matmuls"] < control["matmuls"]


def test_without_checkpointing_plain_peft_already_stops_and_the_hooks_are_removed():
    # the control of the non-checkpointed case: no hook, no graph below the adapters
    assert _backward_below(None, stop=False)["executed"] == []
    model = get_peft_model(tiny_model("llama", num_hidden_layers=4), LoraConfig(r=4, target_modules=["q_proj"]))
    model.enable_input_require_grads()  # transformers' hook (kept in _require_grads_hooks)
    embeddings = model.get_input_embeddings()
    embeddings.register_forward_hook(lambda m, a, o: None)  # someone else's hook stays

    def make_inputs_require_grad(module, input, output):  # peft's fallback, registered without a handle
        output.requires_grad_(True)

    embeddings.register_forward_hook(make_inputs_require_grad)
    assert embeddings(torch.tensor([1])).requires_grad
    stop_backward_below(model, 0)
    assert not embeddings(torch.tensor([1])).requires_grad
    assert len(embeddings._forward_hooks) == 1
    blocks = model.base_model.model.model.layers
    hooks = len(blocks[0]._forward_pre_hooks)
    stop_backward_below(model, 0)  # calling again (e.g. once more at on_train_begin) replaces, never stacks
    assert len(blocks[0]._forward_pre_hooks) == hooks == 1


def test_unadapted_linears_below_the_adapted_blocks_become_nvfp4():
    model = tiny_model("llama", num_hidden_layers=4)
    model = get_peft_model(model, LoraConfig(r=4, target_modules=speed_targets(model, 2), init_lora_weights=False))
    keep = "model.layers.0.mlp.down_proj"
    backend = get_backend("torch")
    replaced = quantize_unadapted(model, protected=[keep], backend=backend)
    assert len(replaced) == 13 and keep not in replaced and {block_index(n) for n in replaced} == {0, 1}
    inner = model.base_model.model
    assert type(inner.get_submodule(keep)) is torch.nn.Linear
    frozen = inner.get_submodule("model.layers.1.self_attn.q_proj")
    assert isinstance(frozen, FrozenLinear) and frozen.backend is backend  # the model's one backend
    assert type(inner.get_submodule("model.layers.2.self_attn.q_proj").get_base_layer()) is torch.nn.Linear
    stop_backward_below(model, lowest_trainable_block(model))
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    assert quantize_unadapted(model, protected=[keep]) == []  # idempotent


def test_trainable_parameters_below_the_cut_are_refused():
    model = tiny_model("llama", num_hidden_layers=4)
    model = get_peft_model(model, LoraConfig(r=4, target_modules=speed_targets(model, 3)))
    with pytest.raises(ValueError, match="found trainable parameters below block 2.*layers.1"):
        stop_backward_below(model, 2)
    everything = get_peft_model(tiny_model("llama", num_hidden_layers=4), LoraConfig(r=4, target_modules=["q_proj"]))
    with pytest.raises(ValueError, match="below block 1.*layers.0.self_attn.q_proj"):
        stop_backward_below(everything, 1)
    trained_embeddings = tiny_model("llama", num_hidden_layers=4)
    trained_embeddings = get_peft_model(
        trained_embeddings,
        LoraConfig(r=4, target_modules=speed_targets(trained_embeddings, 1), modules_to_save=["embed_tokens"]),
    )
    with pytest.raises(ValueError, match="input embeddings"):
        stop_backward_below(trained_embeddings, 3)
    with pytest.raises(ValueError, match="lowest_block=4 must be an integer from 0 to 3"):
        stop_backward_below(model, 4)


# ------------------------------------------------------------------------------ strategyqa data (accuracy bench)


def _strategyqa():
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "strategyqa.py"
    if "strategyqa" not in sys.modules:  # benchmarks/ is not a package; dataclasses need the module registered
        spec = importlib.util.spec_from_file_location("strategyqa", path)
        sys.modules["strategyqa"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules["strategyqa"])
    return sys.modules["strategyqa"]


def _task_json(examples) -> bytes:
    return json.dumps({"name": "strategyqa", "examples": examples}).encode()


def test_strategyqa_is_read_from_the_sdist_layout_and_split_reproducibly(tmp_path):
    sq = _strategyqa()
    # a tiny stand-in for bigbench-1.0.0.tar.gz, same layout and JSON format (invented questions)
    examples = [{"input": f"Is {i} an even number? ", "target_scores": {"Yes": int(i % 2 == 0), "No": i % 2},
                 "target": "Yes." if i % 2 == 0 else "No."} for i in range(10)]  # fmt: skip
    sdist = tmp_path / "bigbench-1.0.0.tar.gz"
    with tarfile.open(sdist, "w:gz") as tar:
        for task, data in [("other_task", _task_json([])), ("strategyqa", _task_json(examples))]:
            info = tarfile.TarInfo(f"bigbench-1.0.0/bigbench/benchmark_tasks/{task}/task.json")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    task = sq.extract_task(sdist, tmp_path / "cache" / "strategyqa" / "task.json")
    loaded = sq.load_examples(task)
    assert [e.answer for e in loaded] == [i % 2 == 0 for i in range(10)]
    assert loaded[3].question == "Is 3 an even number?"
    train, test = sq.split(loaded, 3, seed=0)
    assert (train, test) == sq.split(loaded, 3, seed=0) and len(test) == 3
    assert sorted(map(str, train + test)) == sorted(map(str, loaded))
    assert sq.split(loaded, 3, seed=1) != (train, test)
    assert sq.prompt(loaded[3].question) == "Question: Is 3 an even number?\nAnswer (yes or no):"
    with pytest.raises(FileNotFoundError, match="no bigbench/benchmark_tasks/social_iqa/task.json"):
        sq.extract_task(sdist, tmp_path / "x.json", member="bigbench/benchmark_tasks/social_iqa/task.json")
    (tmp_path / "bad.json").write_bytes(_task_json([{"input": "?", "target_scores": {"A": 1, "B": 0}}]))
    with pytest.raises(ValueError, match="example 0 is not a yes/no question"):
        sq.load_examples(tmp_path / "bad.json")
    with pytest.raises(ValueError, match="test_size=10 must be between 1 and 9"):
        sq.split(loaded, 10)
