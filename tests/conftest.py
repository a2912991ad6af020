import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


def tiny_model(arch: str = "llama", seed: int = 0, **overrides):
    torch.manual_seed(seed)
    if arch == "llama":
        return LlamaForCausalLM(LlamaConfig(vocab_size=128, **{**TINY, **overrides}))
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=128, **{**TINY, **overrides}))


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


@pytest.fixture(params=["llama", "qwen2"])
def arch(request):
    return request.param
