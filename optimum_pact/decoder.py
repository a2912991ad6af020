"""A lean decoder for answering: a saved packed NVFP4 base plus one LoRA adapter, greedy, without transformers.

`pact generate` on a tagging adapter answers one word; importing transformers and peft to build the model that says it
took 4-5 s of a 7-8 s call on 2 cores (issue 50). `PackedDecoder` reads the packed folder PACT caches for the base
(`commands/packed_cache.py`: `save_pretrained`'s codes, scales, 16-bit linears and the rest, memory-mapped) and runs
the Llama / Qwen2 decoder as transformers computes it, op for op: the same RMSNorm, rotary tables, sdpa call (no mask:
one unpadded sequence), KV cache concatenation, the output head on the last position only (through
`head.head_product`, as a PACT-loaded model's head), and each linear through
the same products as `PactLoraLinear` (the backend's fused decoding product where it takes the rows, else
`LoraFrozenProduct`). Its logits are the full path's bit for bit (tests/test_pact_quick.py).

It covers what that path needs and nothing more: one sequence, greedy, model types in `ARCHITECTURES` with default
rotary embeddings and no sliding window. `unsupported(config)` names what it does not cover; callers then use the
full path.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open

from .backends import get_backend
from .dataflow import FrozenLinear
from .dataflow.overlap import LoraFrozenProduct
from .head import head_product

ARCHITECTURES = ("llama", "qwen2")  # model types it runs (Qwen2's q/k/v biases are read where the folder has them)
PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
PROJECTIONS += ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def unsupported(config: dict) -> str | None:
    """Why `PackedDecoder` cannot run a model with this config.json (None: it can)."""
    kind = config.get("model_type")
    if kind not in ARCHITECTURES:
        return f"model_type {kind!r}"
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        return f"rope_type {rope.get('rope_type', rope.get('type'))!r}"
    if config.get("use_sliding_window") or config.get("hidden_act", "silu") != "silu" or config.get("mlp_bias"):
        return "sliding window, activation or MLP bias"
    if _head_dim(config) > 256:
        return "head_dim over 256"
    return None


def _require_supported(config: dict) -> None:
    why = unsupported(config)
    if why is not None:
        raise ValueError(f"PackedDecoder does not run {why}")


def _head_dim(config: dict) -> int:
    return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


class _Linear:
    """One targeted linear: its FrozenLinear, and the adapter's A, B and scaling where it has one."""

    def __init__(self, base: FrozenLinear):
        self.base, self.lora, self.fused = base, None, None

    def add_lora(self, a: torch.Tensor, b: torch.Tensor, scaling: float) -> None:
        self.lora = (a, b, scaling)
        self.fused = self.base.backend.bind_lora(self.base.handle, a, b, scaling)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.lora is None:
            return self.base(x)
        base = self.base
        if self.fused is not None and (y := self.fused(x)) is not None:
            return y if base.bias is None else y + base.bias.to(y.dtype)
        a, b, scaling = self.lora
        return LoraFrozenProduct.apply(x, a, b, scaling, base.backend, base.handle, base.bias, None, False)


class PackedDecoder:
    """The decoder of a packed folder (`from_folder`), an adapter added with `add_lora`, run by `greedy`."""

    def __init__(self, config: dict, tensors: dict[str, torch.Tensor], backend_name: str = "torch"):
        _require_supported(config)
        self.config, self.folder = config, None
        self.heads, self.kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
        self.head_dim, self.eps = _head_dim(config), config["rms_norm_eps"]
        self.scaling = self.head_dim**-0.5
        self.dtype = tensors["model.embed_tokens.weight"].dtype
        self.embed = tensors["model.embed_tokens.weight"]
        self.norm = tensors["model.norm.weight"]
        self.head = tensors.get("lm_head.weight", self.embed)  # absent: tied to the embeddings
        backend = get_backend(backend_name)
        self.linears: dict[str, _Linear] = {}
        for i in range(config["num_hidden_layers"]):
            for name in PROJECTIONS:
                key = f"model.layers.{i}.{name}"
                self.linears[key] = _Linear(_frozen(tensors, key, backend, self.dtype))
        norm = "model.layers.{}.{}_layernorm.weight".format
        layers = range(config["num_hidden_layers"])
        self.norms = [(tensors[norm(i, "input")], tensors[norm(i, "post_attention")]) for i in layers]
        rope = config.get("rope_parameters") or {}
        theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
        dim = self.head_dim
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))

    @classmethod
    def from_folder(cls, folder: str | Path, backend_name: str = "torch") -> PackedDecoder:
        """The decoder of the packed base saved in `folder` (config.json, *.safetensors), memory-mapped."""
        folder = Path(folder)
        config = json.loads((folder / "config.json").read_text())
        _require_supported(config)  # before any tensor is mapped
        tensors = {}
        for file in sorted(folder.glob("*.safetensors")):
            with safe_open(file, "pt") as f:
                tensors.update({key: f.get_tensor(key) for key in f.keys()})
        decoder = cls(config, tensors, backend_name)
        decoder.folder = folder
        return decoder

    def add_lora(self, weights: dict[str, torch.Tensor], scaling: float) -> None:
        """Add a LoRA adapter: `weights` as peft saves them (`base_model.model.<module>.lora_A.weight`, ...), in
        fp32 as peft holds them for a 16-bit base. A key this decoder has no place for is a ValueError."""
        pairs: dict[str, dict[str, torch.Tensor]] = {}
        for key, tensor in weights.items():
            module, _, part = key.removeprefix("base_model.model.").rpartition(".lora_")
            if module not in self.linears or part not in ("A.weight", "B.weight"):
                raise ValueError(f"adapter weight {key!r} has no place in this decoder")
            sixteen = tensor.dtype in (torch.float16, torch.bfloat16)
            pairs.setdefault(module, {})[part[0]] = tensor.float() if sixteen else tensor
        for module, ab in pairs.items():
            base = self.linears[module].base
            a, b = ab.get("A"), ab.get("B")
            if a is None or b is None or a.shape[1] != base.in_features or b.shape != (base.out_features, a.shape[0]):
                raise ValueError(f"adapter module {module!r}: lora_A / lora_B missing or not of this base's shape")
            self.linears[module].add_lora(a, b, scaling)

    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return weight * h.to(x.dtype)

    def _attention(self, i: int, x: torch.Tensor, cos, sin, cache: list) -> torch.Tensor:
        b, t, _ = x.shape
        shape, prefix = (b, t, -1, self.head_dim), f"model.layers.{i}.self_attn."
        q, k, v = (self.linears[prefix + p](x).view(shape).transpose(1, 2) for p in ("q_proj", "k_proj", "v_proj"))
        q, k = (q * cos) + (_rotate_half(q) * sin), (k * cos) + (_rotate_half(k) * sin)
        if len(cache) > i:
            k, v = torch.cat([cache[i][0], k], dim=-2), torch.cat([cache[i][1], v], dim=-2)
            cache[i] = (k, v)
        else:
            cache.append((k, v))
        gqa = {"enable_gqa": True} if self.heads > self.kv_heads else {}
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, scale=self.scaling,
                                             is_causal=t > 1, **gqa)  # fmt: skip
        out = out.reshape(b, -1, t, self.head_dim).transpose(1, 2).contiguous()
        return self.linears[prefix + "o_proj"](out.reshape(b, t, -1).contiguous())

    def _mlp(self, i: int, x: torch.Tensor) -> torch.Tensor:
        prefix = f"model.layers.{i}.mlp."
        gate, up, down = (self.linears[prefix + p] for p in ("gate_proj", "up_proj", "down_proj"))
        return down(F.silu(gate(x)) * up(x))

    @torch.no_grad()
    def next_logits(self, ids: torch.Tensor, cache: list) -> torch.Tensor:
        """The float32 logits after `ids` ([1, T] new tokens) given `cache` (extended in place: pass [] first)."""
        past = cache[0][0].shape[-2] if cache else 0
        h = F.embedding(ids, self.embed)
        positions = torch.arange(past, past + ids.shape[1]).unsqueeze(0)
        freqs = positions[..., None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(h.dtype).unsqueeze(1), emb.sin().to(h.dtype).unsqueeze(1)
        for i, (pre, post) in enumerate(self.norms):
            h = h + self._attention(i, self._rms(h, pre), cos, sin, cache)
            h = h + self._mlp(i, self._rms(h, post))
        last = self._rms(h, self.norm)[:, -1:, :]
        return head_product(last.view(last.shape), self.head, self)[:, -1, :].to(copy=True, dtype=torch.float32)

    def greedy(self, ids: list[int], max_new_tokens: int, eos: set[int], on_token=None) -> list[int]:
        """Greedy tokens after `ids`, at most `max_new_tokens`, the end of sequence included when reached;
        `on_token(token)` is called on each as it comes."""
        cache: list = []
        new: list[int] = []
        step = torch.tensor([ids])
        while len(new) < max_new_tokens:
            token = int(self.next_logits(step, cache).argmax(-1))
            new.append(token)
            if on_token is not None:
                on_token(token)
            if token in eos:
                break
            step = torch.tensor([[token]])
        return new


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _frozen(tensors: dict, key: str, backend, dtype: torch.dtype) -> FrozenLinear:
    """The FrozenLinear saved under `key`: packed (uint8 codes) or kept 16-bit, holding the mapped tensors themselves
    (`assign`), checked by FrozenLinear's own state-dict loading."""
    weight = tensors[f"{key}.weight"]
    nvfp4 = weight.dtype == torch.uint8
    n, k = weight.shape[0], weight.shape[1] * (2 if nvfp4 else 1)
    layer = FrozenLinear(k, n, bias=f"{key}.bias" in tensors, backend=backend, dtype=dtype, device="meta",
                         precision="nvfp4" if nvfp4 else "fp16",
                         weight_dtype=torch.float16 if nvfp4 else weight.dtype)  # fmt: skip
    names = [*layer.layout(), *(["bias"] if layer.bias is not None else [])]
    layer.load_state_dict({name: tensors[f"{key}.{name}"] for name in names}, assign=True)
    return layer


__all__ = ["ARCHITECTURES", "PackedDecoder", "unsupported"]
