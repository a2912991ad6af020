import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


def tiny_model(arch: str = "llama", seed: int = 0, **overrides):
    torch.manual_seed(seed)
    if arch == "llama":
        return LlamaForCausalLM(LlamaConfig(vocab_size=128, **{**TINY, **overrides}))
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=128, **{**TINY, **overrides}))


@pytest.fixture(params=["llama", "qwen2"])
def arch(request):
    return request.param
