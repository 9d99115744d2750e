"""fusetune.nn.GatedSlotAttention: the layer around the op, and a transformers model with its
attention swapped for it."""

from __future__ import annotations

import pytest
import torch

import fusetune
import fusetune.nn.gsa as layer_module
from fusetune.reference.gsa import gated_slot_attention as naive
from harness import DEVICE, assert_close


def make_layer(**kw) -> fusetune.nn.GatedSlotAttention:
    torch.manual_seed(0)
    options = dict(hidden_size=32, num_heads=2, num_kv_heads=1, num_slots=8, head_dim=16)
    return fusetune.nn.GatedSlotAttention(**(options | kw)).to(DEVICE)


def run_layer(layer, x, **kwargs):
    x = x.clone().requires_grad_()
    out, weights = layer(x, **kwargs)
    assert weights is None
    out.backward(torch.ones_like(out))
    grads = {name: p.grad.clone() for name, p in layer.named_parameters()}
    layer.zero_grad(set_to_none=True)
    return out.detach(), x.grad, grads


@pytest.mark.parametrize("mode", ["chunk", "recurrent"])
def test_layer_matches_naive(mode, monkeypatch):
    layer = make_layer(mode=mode)
    x = torch.randn(2, 19, 32, device=DEVICE)
    got = run_layer(layer, x)
    monkeypatch.setattr(
        layer_module, "gated_slot_attention", lambda *a, mode=None, **kw: naive(*a, **kw)
    )
    want = run_layer(layer, x)
    assert_close("output", got[0], want[0], 1e-5)
    assert_close("grad x", got[1], want[1], 1e-5)
    for name in got[2]:
        assert_close(f"grad {name}", got[2][name], want[2][name], 1e-5)


def test_left_padding_leaves_the_tokens_alone():
    """With a 2-D mask, padded tokens neither write nor decay the memory."""
    layer = make_layer()
    x = torch.randn(1, 12, 32, device=DEVICE)
    padded = torch.cat([torch.randn(1, 5, 32, device=DEVICE), x], dim=1)
    mask = torch.cat([torch.zeros(1, 5), torch.ones(1, 12)], dim=1).to(DEVICE)
    with torch.no_grad():
        alone, _ = layer(x)
        with_padding, _ = layer(padded, attention_mask=mask)
    assert_close("padded", with_padding[:, 5:], alone, 1e-5)


def test_bad_options():
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        fusetune.nn.GatedSlotAttention(32, num_heads=3, num_kv_heads=2)
    with pytest.raises(ValueError, match="feature_map"):
        fusetune.nn.GatedSlotAttention(32, num_heads=2, feature_map="elu")


def test_transformers_llama_trains_with_gsa():
    """A tiny Llama with every attention replaced by GatedSlotAttention trains (loss falls)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
    )
    model = transformers.LlamaForCausalLM(config).to(DEVICE)
    for index, layer in enumerate(model.model.layers):
        layer.self_attn = fusetune.nn.GatedSlotAttention(
            32, num_heads=2, num_kv_heads=1, num_slots=8, layer_idx=index
        ).to(DEVICE)
    tokens = torch.randint(0, 64, (2, 20), device=DEVICE)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(3):  # two updates: the loss falls (4 steps cost a third more interpreter time)
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0]
