import pytest

from optimum_pact.commands.data import load_personal_dataset
from optimum_pact.commands.default_model import ensure_default_model


@pytest.mark.slow
def test_default_model_loads_and_classifies():
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from optimum_pact.commands.evaluation import classify, score_labels

    folder = ensure_default_model()  # honours $PACT_CACHE; downloads ~93 MB and converts on first use
    assert ensure_default_model() == folder
    model = AutoModelForCausalLM.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert model.config.num_hidden_layers == 30
    assert model.config.hidden_size == 576
    assert model.config.vocab_size == 49152
    assert model.dtype == torch.float32

    train, heldout = load_personal_dataset()
    labels = sorted({e["label"] for e in train})
    notes = heldout[:3]
    model.train()
    texts = [e["text"] for e in notes]
    preds = classify(model, tokenizer, texts, labels, batch_size=2)
    assert model.training  # classify restores the training mode
    scores = score_labels(model, tokenizer, texts, labels, batch_size=3)  # another batching: the same scores
    assert scores.shape == (3, len(labels)) and torch.isfinite(scores).all() and (scores < 0).all()  # log-probs
    assert preds == [labels[j] for j in scores.argmax(-1).tolist()]


class CharTokenizer:
    """A stand-in tokenizer: one id per character, no special tokens, no pad token."""

    pad_token_id = None
    eos_token_id = 1

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        return {"input_ids": [2 + ord(c) % 60 for c in text]}


def tiny_model():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4
    )
    return LlamaForCausalLM(config)


def reference_scores(model, tokenizer, texts, labels):
    """One unpadded forward pass per (text, label): the obvious, slow way."""
    import torch

    from optimum_pact.commands.data import format_example

    rows = []
    with torch.no_grad():
        for text in texts:
            row = []
            for label in labels:
                prompt, target = format_example(text, label)
                prompt_ids = tokenizer(prompt)["input_ids"]
                target_ids = tokenizer(target, add_special_tokens=False)["input_ids"]
                ids = torch.tensor([prompt_ids + target_ids])
                logprobs = torch.log_softmax(model(input_ids=ids).logits[0].float(), dim=-1)
                n = len(prompt_ids)
                row.append(sum(logprobs[n - 1 + k, t].item() for k, t in enumerate(target_ids)))
            rows.append(row)
    return torch.tensor(rows)


def test_scores_match_reference_on_tiny_model():
    import torch

    from optimum_pact.commands.evaluation import classify, score_labels

    model, tokenizer = tiny_model().eval(), CharTokenizer()
    texts = ["buy milk", "call mum about the weekend", "tyres", "a much longer note about nothing at all", "x"] * 2
    labels = ["kin", "kit", "k", "tally", "grind", "ta"]  # shared prefixes, different lengths
    expected = reference_scores(model, tokenizer, texts, labels)
    got = score_labels(model, tokenizer, texts, labels, batch_size=4)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    assert classify(model, tokenizer, texts, labels, batch_size=3) == [labels[j] for j in expected.argmax(-1)]


def test_classify_on_peft_model_restores_mode():
    from peft import LoraConfig, get_peft_model

    from optimum_pact.commands.evaluation import accuracy, classify

    model = get_peft_model(tiny_model(), LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    model.train()
    preds = classify(model, CharTokenizer(), ["buy milk", "fix the tap"], ["kin", "mend"])
    assert set(preds) <= {"kin", "mend"} and model.training
    assert accuracy(["a", "b"], ["a", "c"]) == 0.5
    with pytest.raises(ValueError):
        accuracy(["a"], [])
