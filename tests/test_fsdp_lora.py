"""fusetune.integrations.fsdp.shard_lora at 2 ranks against FSDP2 sharding everything, on the
same batches: a PEFT LoRA tiny Llama under fusetune.apply, two micro-batches accumulated per
step, AdamW. Per-step losses, the adapters' gradients and their updated values agree in fp32;
the adapters stay plain tensors (replicated) while the base is sharded; the fused LoRA op runs.
Gloo on the CPU, NCCL on a machine with 2 GPUs: the 2-rank runs are made in
test_distributed.py's spawn (``runs``) and checked there (``check_runs``)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import fusetune
from fusetune.integrations import peft as peft_integration
from fusetune.integrations.fsdp import shard_lora
from harness import assert_close
from test_transformers import ADAM_EPS, LR, lora_model

peft = pytest.importorskip("peft")
WORLD, STEPS, MICRO, ROWS, SEQ = 2, 2, 2, 2, 8


def batches(vocab: int) -> list[torch.Tensor]:
    """STEPS x MICRO batches of WORLD * ROWS rows: each rank trains on its ROWS."""
    generator = torch.Generator().manual_seed(3)
    return [torch.randint(3, vocab, (WORLD * ROWS, SEQ), generator=generator)
            for _ in range(STEPS * MICRO)]  # fmt: skip


def full(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().cpu()


def train(model, rank: int, device: torch.device) -> tuple[list[float], list[dict]]:
    """(losses averaged over ranks, adapter gradients per step)."""
    trained = {n: p for n, p in model.named_parameters() if p.requires_grad}
    optimizer = torch.optim.AdamW(trained.values(), lr=LR, eps=ADAM_EPS)
    data = batches(model.config.vocab_size)
    losses, grads = [], []
    for step in range(STEPS):
        total = torch.zeros((), device=device)
        for ids in data[step * MICRO : (step + 1) * MICRO]:
            rows = ids.chunk(WORLD)[rank].to(device)
            loss = model(input_ids=rows, labels=rows).loss / MICRO
            loss.backward()
            total += loss.detach()
        grads.append({n: full(p.grad) for n, p in trained.items()})
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        dist.all_reduce(total)
        losses.append(total.item() / WORLD)
    return losses, grads


def runs(rank: int, device: torch.device) -> dict:
    """FSDP2 sharding everything, then shard_lora, on this rank of a joined group. Run inside
    test_distributed's spawn (one process group for every FSDP2 and ZeRO-3 case: a spawn of
    2 ranks costs ~25 s of imports on CI's CPU); checked by check_runs."""
    return {layout: run(layout, rank, device) for layout in ("all-sharded", "shard_lora")}


def run(layout: str, rank: int, device: torch.device) -> dict:
    from torch.distributed.fsdp import fully_shard

    model = lora_model("llama", num_hidden_layers=2).to(device)
    fusetune.apply(model)
    if layout == "shard_lora":
        shard_lora(model)
    else:
        for layer in model.get_base_model().model.layers:
            fully_shard(layer)
        fully_shard(model)
    calls = []
    fused = peft_integration.lora_linear_validated
    peft_integration.lora_linear_validated = lambda *a: calls.append(1) or fused(*a)
    try:
        losses, grads = train(model, rank, device)
    finally:
        peft_integration.lora_linear_validated = fused
    trained = [p for p in model.parameters() if p.requires_grad]
    frozen = [p for p in model.parameters() if not p.requires_grad]
    return {
        "losses": losses,
        "grads": grads,
        "adapters": {n: full(p) for n, p in model.named_parameters() if p.requires_grad},
        "replicated": not any(isinstance(p, DTensor) for p in trained),
        "base sharded": all(isinstance(p, DTensor) for p in frozen),
        "lora calls": len(calls),
    }


def check_runs(runs: dict) -> None:
    """shard_lora trains as FSDP2 sharding everything (test_distributed's
    test_fsdp2_matches_one_process_and_zero3_matches_unpatched_zero3 runs both on 2 ranks):
    adapters replicated, base sharded, the fused LoRA op run as often, the same losses,
    adapter gradients and updated adapters."""
    got, want = runs["shard_lora"], runs["all-sharded"]
    assert got["replicated"] and got["base sharded"] and not want["replicated"]
    assert got["lora calls"] == want["lora calls"] > 0
    assert_close("losses", torch.tensor(got["losses"]), torch.tensor(want["losses"]), 1e-6)
    for step, (grads, want_grads) in enumerate(zip(got["grads"], want["grads"], strict=True)):
        assert grads.keys() == want_grads.keys() and want_grads
        for name, grad in want_grads.items():
            assert_close(f"step {step} grad {name}", grads[name], grad, 1e-5, atol=1e-9)
    for name, value in want["adapters"].items():
        assert_close(f"adapter {name}", got["adapters"][name], value, 1e-5)


def test_shard_lora_refuses_what_it_cannot_shard():
    """The checks come before any collective: no process group needed."""
    model = lora_model("llama", num_hidden_layers=1)
    with pytest.raises(ValueError, match="layers: none given"):
        shard_lora(model, layers=[])
    model.requires_grad_(False)
    with pytest.raises(ValueError, match="model: no trainable parameter"):
        shard_lora(model)
    model.requires_grad_(True)
    with pytest.raises(ValueError, match="model: every parameter trains"):
        shard_lora(model)


def test_plain_peft_layers_under_a_narrower_policy_are_named():
    """FSDP2's policy does not cast the replicated adapters: PEFT layers fusetune does not route
    would run their LoRA products in float32 (measured slower on 2x H100). shard_lora says so
    before sharding; routed layers, 16-bit adapters or no policy say nothing."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from fusetune.integrations.fsdp import adapters_left_wide

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    model = lora_model("llama", num_hidden_layers=1)
    note = adapters_left_wide(model, policy)
    assert note is not None and "7 PEFT LoRA layers" in note and "fusetune.apply" in note
    with pytest.warns(UserWarning, match="shard_lora: 7 PEFT LoRA layers"):
        with pytest.raises((RuntimeError, ValueError)):  # no process group: fully_shard refuses
            shard_lora(model, mp_policy=policy)
    assert adapters_left_wide(model, None) is None
    assert adapters_left_wide(model, MixedPrecisionPolicy()) is None
    fusetune.apply(model)
    assert adapters_left_wide(model, policy) is None
    fusetune.revert(model)
    model.to(torch.bfloat16)
    assert adapters_left_wide(model, policy) is None
