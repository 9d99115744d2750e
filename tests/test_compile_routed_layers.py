"""Routed live-model parts (MoE experts -> moe_mlp, Gated DeltaNet -> gated_delta_rule) under
per-layer torch.compile (torchtitan's way, what FSDP2 + compile needs): fusetune compiles no
more graphs than plain transformers, none again on later steps (a forward object per module,
or a call counter Dynamo guarded, compiled again per layer or per call), its fused ops run
inside the graphs, and training matches eager.

CPU: aot_eager (see tests/test_compile_layers.py); GPU: Inductor."""

from __future__ import annotations

import pytest
import torch

import fusetune
from harness import DEVICE, ON_GPU, assert_close, fused_ops_run, graphs_compiled

transformers = pytest.importorskip("transformers")

BACKEND = "inductor" if ON_GPU else "aot_eager"
LAYERS, STEPS, VOCAB = 4, 2, 64
TOL = 1e-5  # fp32, relative


def qwen3_moe(fused: bool) -> torch.nn.Module:
    config = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=LAYERS, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, intermediate_size=64, moe_intermediate_size=48,
        num_experts=4, num_experts_per_tok=2, use_cache=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(config).to(DEVICE)
    return fusetune.apply(model) if fused else model


def qwen3_5(fused: bool) -> torch.nn.Module:
    if not hasattr(transformers, "Qwen3_5ForCausalLM"):
        pytest.skip(f"transformers {transformers.__version__} has no Qwen3.5")
    config = transformers.Qwen3_5TextConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=LAYERS,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        layer_types=["linear_attention", "full_attention"] * (LAYERS // 2),
        linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=16,
        linear_value_head_dim=16, use_cache=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.Qwen3_5ForCausalLM(config).float().to(DEVICE)
    return fusetune.apply(model) if fused else model


def train(model, compiled: bool):
    """STEPS SGD steps, each layer compiled on its own when ``compiled``: (losses, gradients of
    every step, graphs compiled after each step, fusetune's ops of the last step). A patched
    model is reverted after (its routing is module-wide while it lives)."""
    try:
        return _train(model, compiled)
    finally:
        fusetune.revert(model)


def _train(model, compiled: bool):
    torch._dynamo.reset()
    if compiled:
        for layer in model.model.layers:
            layer.compile(backend=BACKEND)
    generator = torch.Generator().manual_seed(1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    before = graphs_compiled()
    losses, grads, graphs, ran = [], [], [], {}
    for index in range(STEPS):
        ids = torch.randint(0, VOCAB, (2, 8), generator=generator).to(DEVICE)

        def step(ids=ids):
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            losses.append(loss.detach())

        ran = fused_ops_run(step) if index == STEPS - 1 else step()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        optimizer.step()
        optimizer.zero_grad()
        graphs.append(graphs_compiled() - before)
    return losses, grads, graphs, ran


def assert_same_training(got, want) -> None:
    for step, (loss, want_loss) in enumerate(zip(got[0], want[0], strict=True)):
        assert_close(f"loss {step}", loss, want_loss, TOL)
    for step, (grads, want_grads) in enumerate(zip(got[1], want[1], strict=True)):
        assert grads.keys() == want_grads.keys() and want_grads
        for name, grad in want_grads.items():
            assert_close(f"step {step} {name}", grads[name], grad, TOL, atol=1e-9)


def test_qwen3_moe_layers_compile_as_plain_transformers_layers():
    """Experts routed through moe_mlp (fusetune.apply): no more graphs than plain transformers'
    layers, and none again on the next step (fusetune's were 4 after one step, 8 after two: a
    forward object per experts module, and a call count Dynamo guarded); moe_mlp forward and
    backward in every layer of the compiled step; the losses and gradients of eager
    transformers. Plain runs first: a live patched model fuses its family's rope. (Plain layers
    share one graph on the CPU with transformers 5.23; the GPU pass, CUDA with 5.17, compiled
    one per layer.)"""
    plain = train(qwen3_moe(fused=False), compiled=True)
    want = train(qwen3_moe(fused=False), compiled=False)
    got = train(qwen3_moe(fused=True), compiled=True)
    assert plain[2][0] == plain[2][-1] <= LAYERS, plain[2]  # no recompile
    assert got[2][0] == got[2][-1] <= plain[2][0], (got[2], plain[2])
    assert got[3].get("moe_forward") == got[3].get("moe_backward") == LAYERS, got[3]
    assert_same_training(got, want)


def test_qwen3_5_gated_delta_layers_compile_once_per_layer_kind():
    """Gated DeltaNet routed through gated_delta_rule: one graph per kind of layer (linear and
    full attention), none again on the next step; the delta rule runs in both linear-attention
    layers, forward and backward; the same training as the eager routed model. (Plain
    transformers' torch chunk loop fails in its compiled backward on the CPU, so the eager
    routed model is the reference; tests/test_gated_delta_rule.py holds it to transformers.)"""
    got = train(qwen3_5(fused=True), compiled=True)
    assert got[2][0] == got[2][-1] <= 2, got[2]
    ran = {name: count for name, count in got[3].items() if "gated_delta" in name}
    want = {"gated_delta_rule_forward": LAYERS // 2, "gated_delta_rule_backward": LAYERS // 2}
    assert ran == want, got[3]
    assert_same_training(got, train(qwen3_5(fused=True), compiled=False))
