"""A Hugging Face model trained with `use_cache` on broke selective activation checkpointing in the backward (found in
issue 41's CPU measurements): its blocks write the KV cache during the forward, and the recomputation then met ops the
forward had not saved ("aten.slice.Tensor ... encountered during backward but not found in storage"). The trainer's
checkpointing (trainers.strategy.checkpoint_activations) turns the cache off first, in the model and in one nested in
the task's model."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from trainers.strategy import checkpoint_activations  # noqa: E402

pytestmark = pytest.mark.train  # importing transformers takes ~6 s


def tiny(kind: str) -> torch.nn.Module:
    if kind == "llama":
        cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    else:
        cfg = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                      bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    model.config.use_cache = True  # as a config.json from the Hub says
    return model.train()


class Wrapped(torch.nn.Module):
    """A task's own model holding the HF one."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(input_ids=x, labels=x).loss


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
@pytest.mark.parametrize("nested", [False, True])
def test_selective_checkpointing_of_an_hf_model_with_use_cache_on_trains(kind: str, nested: bool) -> None:
    hf = tiny(kind)
    model = Wrapped(hf) if nested else hf
    assert checkpoint_activations(model, "selective") == 2
    x = torch.randint(0, 64, (2, 16))
    loss = model(x) if nested else model(input_ids=x, labels=x).loss
    loss.backward()  # raised before: the recomputation met ops the forward had not saved
    assert hf.config.use_cache is False
    assert all(p.grad is not None for p in hf.parameters() if p.requires_grad)
