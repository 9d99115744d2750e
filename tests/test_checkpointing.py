"""Gradient checkpointing with host offload (fusetune.integrations.checkpointing): the same
gradients as no checkpointing in fp32 (full and LoRA models, with fusetune applied), and on the
GPU the layer inputs really leave the device."""

from __future__ import annotations

import copy

import pytest
import torch

import fusetune
from fusetune.integrations import checkpointing
from harness import DEVICE, assert_close
from test_transformers import lora_model, make_batches, tiny_model

pytestmark = pytest.mark.filterwarnings("ignore:.*checkpointing.*:FutureWarning")


def gradients(model, ids, labels):
    model.train()
    model.zero_grad(set_to_none=True)
    model(input_ids=ids, labels=labels).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_offloaded_checkpointing_gives_the_same_gradients(kind, monkeypatch):
    maker = lora_model if kind == "lora" else tiny_model
    model = maker("llama", num_hidden_layers=2)
    ((ids, labels),) = make_batches(1)
    want = gradients(copy.deepcopy(model), ids, labels)
    fusetune.apply(model)
    checkpointing.enable_offloaded_checkpointing(model)
    # offload every saved input, however small: each layer's input goes through the hooks
    monkeypatch.setattr(checkpointing, "MIN_OFFLOAD_BYTES", 0)
    packed = []
    pack = checkpointing.HostOffload.pack
    monkeypatch.setattr(
        checkpointing.HostOffload, "pack", lambda self, t: packed.append(t.shape) or pack(self, t)
    )
    got = gradients(model, ids, labels)
    hidden = model.config.hidden_size
    assert packed == [ids.shape + (hidden,)] * 2, packed  # one layer input per layer
    assert got.keys() == want.keys() and want
    for name, grad in want.items():
        assert_close(f"grad {name}", got[name], grad, 1e-5)


def test_host_offload_round_trip():
    """A CUDA tensor goes to pinned host memory and comes back equal; other tensors stay."""
    hooks = checkpointing.HostOffload(min_bytes=0)
    tensor = torch.randn(64, 32, device=DEVICE)
    packed = hooks.pack(tensor)
    if DEVICE.type == "cuda":
        assert packed.host.device.type == "cpu" and packed.host.is_pinned()
        assert torch.equal(hooks.unpack(packed), tensor)
    else:
        assert packed is tensor and hooks.unpack(packed) is tensor
    small = checkpointing.HostOffload(min_bytes=1 << 30)
    assert small.pack(tensor) is tensor


def test_errors_name_the_model():
    with pytest.raises(ValueError, match="Linear.*no layer that transformers checkpoints"):
        checkpointing.enable_offloaded_checkpointing(torch.nn.Linear(2, 2))
