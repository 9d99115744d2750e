"""Benchmark cases for fusetune.moe_mlp: one MoE layer's expert MLP, forward + backward.

Shapes: a Qwen3-30B-A3B layer (E=128, top-8, H=2048, I=768) and a gpt-oss-20b layer (E=32,
top-4, H=2880, I=2880, biases, interleaved gate/up, clamped SwiGLU), 8192 tokens, bf16 experts
(frozen). Variants: LoRA r=16 on gate_up and down (bf16 adapters; x, the routing weights and
the adapters get gradients), and no LoRA (x and the routing weights).

Providers: fusetune; transformers 5.x's experts module (its own class for the family) with
``experts_implementation`` "eager" (the per-expert loop) and "grouped_mm"; with LoRA, that
module wrapped by PEFT's ``target_parameters`` LoRA (the adapters fusetune gets are views of
PEFT's own weights). On the CPU (smoke run) a tiny shape, fusetune (its reference) and eager.

Floor: the grouped GEMMs of the frozen experts, forward and dx: 2 x (2 S H 2I + 2 S I H) FLOPs
with S = tokens x top-k; the LoRA terms and the routing come on top.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

import fusetune
from fusetune.bench.harness import Case, backward_step, register

TOKENS, RANK, ALPHA = 8192, 16, 32
SHAPES = {  # family -> (experts, top_k, hidden, intermediate)
    "qwen3_moe": (128, 8, 2048, 768),
    "gpt_oss": (32, 4, 2880, 2880),
}
CPU_SHAPE = (4, 2, 32, 48)
CPU_TOKENS = 24
TITLES = {"qwen3_moe": "Qwen3-30B-A3B", "gpt_oss": "gpt-oss-20b"}


def _experts_module(family: str, shape, device, dtype):
    """transformers' experts module of ``family`` with random frozen weights (unit scale)."""
    import transformers
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    experts, top_k, hidden, inter = shape
    if family == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(
            hidden_size=hidden,
            moe_intermediate_size=inter,
            num_experts=experts,
            num_experts_per_tok=top_k,
        )
        module = Qwen3MoeExperts(config)
    else:
        config = transformers.GptOssConfig(
            hidden_size=hidden,
            intermediate_size=inter,
            num_local_experts=experts,
            num_experts_per_tok=top_k,
        )
        module = GptOssExperts(config)
    with torch.no_grad():
        for p in module.parameters():
            fan_in = p.shape[-1] if not getattr(module, "is_transposed", False) else p.shape[-2]
            p.copy_(torch.randn_like(p) / (fan_in if p.dim() == 3 else 16) ** 0.5)
    return module.to(device, dtype).requires_grad_(False)


class _Holder(torch.nn.Module):
    """A parent for PEFT to inject into (its wrappers replace ``experts``)."""

    def __init__(self, experts: torch.nn.Module):
        super().__init__()
        self.experts = experts


def _peft_wrapped(module: torch.nn.Module):
    """PEFT's LoRA on gate_up_proj and down_proj (non-zero B, as after training), or None."""
    try:
        from peft import LoraConfig, inject_adapter_in_model
    except ImportError:
        return None
    config = LoraConfig(
        r=RANK,
        lora_alpha=ALPHA,
        target_modules=[],
        init_lora_weights=False,
        target_parameters=["experts.gate_up_proj", "experts.down_proj"],
    )
    holder = inject_adapter_in_model(config, _Holder(module))
    for p in holder.parameters():
        if p.requires_grad:
            p.data.mul_(0.1)
    return holder


def _routing(n, experts, top_k, hidden, device, dtype):
    logits = torch.randn(n, experts, device=device)
    weights, ids = torch.topk(logits.softmax(-1), top_k)
    weights = (weights / weights.sum(-1, keepdim=True)).to(dtype).requires_grad_(True)
    x = torch.randn(n, hidden, device=device, dtype=dtype, requires_grad=True)
    return x, ids, weights


def _make(family: str, lora: bool):
    def make(device: torch.device, quick: bool) -> dict[str, Callable[[], object]]:
        from fusetune.integrations import moe as integration

        cuda = device.type == "cuda"
        shape = SHAPES[family] if cuda else CPU_SHAPE
        n = TOKENS if cuda else CPU_TOKENS
        dtype = torch.bfloat16 if cuda else torch.float32
        experts, top_k, hidden, _ = shape
        module = _experts_module(family, shape, device, dtype)
        x, ids, weights = _routing(n, experts, top_k, hidden, device, dtype)
        top = _peft_wrapped(module) if lora else _Holder(module)
        if top is None:
            return {}
        spec = next(spec for _, spec in integration._candidates(top))
        adapters = [p for p in top.parameters() if p.requires_grad]
        leaves = [x, weights, *adapters]
        grads = [torch.randn(n, hidden, device=device, dtype=dtype)]
        gpt_oss = family == "gpt_oss"

        def ours():
            moe_lora = integration._lora(spec) if lora else None
            return fusetune.moe_mlp(
                x,
                ids,
                weights,
                module.gate_up_proj,
                module.down_proj,
                activation="gpt_oss" if gpt_oss else "swiglu",
                gate_up_bias=getattr(module, "gate_up_proj_bias", None),
                down_bias=getattr(module, "down_proj_bias", None),
                lora=moe_lora,
                transposed=gpt_oss,
                interleaved=gpt_oss,
                alpha=float(getattr(module, "alpha", 1.702)),
                limit=float(getattr(module, "limit", 7.0)),
            )

        def transformers_impl(name):
            def run():
                module.config._experts_implementation = name
                return top.experts(x, ids, weights)

            return run

        providers = {"fusetune": backward_step(ours, grads, leaves)}
        implementations = ["eager", "grouped_mm"] if cuda else ["eager"]
        label = "transformers+peft" if lora else "transformers"
        for name in implementations:
            providers[f"{label} {name}"] = backward_step(transformers_impl(name), grads, leaves)
        return providers

    return make


def _floor(family: str) -> Callable[[bool], float]:
    def floor(quick: bool) -> float:
        experts, top_k, hidden, inter = SHAPES[family]
        slots = TOKENS * top_k
        return 2 * (2.0 * slots * hidden * 2 * inter + 2.0 * slots * inter * hidden)

    return floor


for _family, (_e, _k, _h, _i) in SHAPES.items():
    for _lora in (True, False):
        _variant = f"LoRA r{RANK}" if _lora else "frozen, no LoRA"
        register(
            Case(
                op="moe",
                name=f"{TITLES[_family]} E{_e} top{_k} H{_h} I{_i} {TOKENS} tok bf16 {_variant}",
                make=_make(_family, _lora),
                floor_flops=_floor(_family),
            )
        )
