"""Benchmark cases for fusetune.moe_mlp: one MoE layer's expert MLP, forward + backward.

Shapes: a Qwen3-30B-A3B layer (E=128, top-8, H=2048, I=768) and a gpt-oss-20b layer (E=32,
top-4, H=2880, I=2880, biases, interleaved gate/up, clamped SwiGLU), 8192 tokens, bf16 experts
(frozen). Variants: LoRA r=16 on gate_up and down (bf16 adapters; x, the routing weights and
the adapters get gradients), and no LoRA (x and the routing weights).

Providers: fusetune; transformers 5.x's experts module (its own class for the family) with
``experts_implementation`` "eager" (the per-expert loop) and "grouped_mm"; with LoRA, that
module wrapped by PEFT's ``target_parameters`` LoRA (the adapters fusetune gets are views of
PEFT's own weights). Without LoRA at the Qwen3 shape also Liger-Kernel's fused MoE (which
forms the experts' weight gradients too: for scale). On the CPU (smoke run) a tiny shape,
fusetune (its reference) and eager.

Also an e2e LoRA step (forward, backward, AdamW) of a reduced-depth Qwen3-MoE (Qwen3-30B-A3B
widths, 4 layers, batch 4 x 2048) with PEFT LoRA r16 on attention and on the experts' 3-D
parameters, HF + PEFT against fusetune (``fusetune.apply`` plus ``integrations.moe.route``).

Floor: the grouped GEMMs of the frozen experts, forward and dx: 2 x (2 S H 2I + 2 S I H) FLOPs
with S = tokens x top-k; the LoRA terms and the routing come on top.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

import fusetune
from fusetune.bench.cases_e2e import make_step
from fusetune.bench.harness import Case, backward_step, register
from fusetune.graphed_step import DEFAULT_WARMUP

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
        liger = _liger(module, x, ids, weights) if cuda and not lora and not gpt_oss else None
        if liger is not None:
            providers["liger fused_moe (+ expert dW)"] = backward_step(liger, grads, leaves)
        return providers

    return make


def _liger(module, x, ids, weights) -> Callable[[], object] | None:
    """Liger-Kernel's fused MoE (``ops.fused_moe``, 0.8.x): Qwen3-MoE's layout (gate_up [E, 2I,
    H], gate rows first; down [E, H, I]), SwiGLU, no biases, no LoRA. Its backward always forms
    the experts' weight gradients (a full fine-tuning op), so its row does more work than the
    frozen-expert providers: it is there for scale, not as a like-for-like peer. None where
    Liger-Kernel is not installed."""
    try:
        from liger_kernel.ops.fused_moe import LigerFusedMoEFunction
    except ImportError:
        return None
    index = ids.to(torch.int32)
    return lambda: LigerFusedMoEFunction.apply(
        x, module.gate_up_proj, module.down_proj, index, weights
    )


def _floor(family: str) -> Callable[[bool], float]:
    def floor(quick: bool) -> float:
        experts, top_k, hidden, inter = SHAPES[family]
        slots = TOKENS * top_k
        return 2 * (2.0 * slots * hidden * 2 * inter + 2.0 * slots * inter * hidden)

    return floor


# ----------------------------------------------------------------------------- e2e step

# Qwen3-30B-A3B's widths at 4 layers (the reduced-depth shape), batch 4 x 2048 tokens.
E2E_CONFIG = dict(
    vocab_size=151936,
    hidden_size=2048,
    intermediate_size=6144,
    moe_intermediate_size=768,
    num_hidden_layers=4,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    num_experts=128,
    num_experts_per_tok=8,
    norm_topk_prob=True,
    output_router_logits=True,
)
E2E_TINY = dict(
    vocab_size=256,
    hidden_size=32,
    intermediate_size=64,
    moe_intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    num_experts=4,
    num_experts_per_tok=2,
)
E2E_BATCH, E2E_SEQ = 4, 2048
E2E_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]


def _e2e_model(device: torch.device, fused: bool) -> torch.nn.Module:
    """Random-weight reduced Qwen3-MoE with PEFT LoRA r16 on attention and on the experts'
    3-D parameters (target_parameters), trained-looking B; fusetune applied when ``fused``."""
    import peft
    import transformers

    cuda = device.type == "cuda"
    settings = dict(E2E_CONFIG, **({} if cuda else E2E_TINY))
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**settings))
    model.to(torch.bfloat16 if cuda else torch.float32)
    model.config.use_cache = False
    config = peft.LoraConfig(
        r=RANK,
        lora_alpha=ALPHA,
        target_modules=E2E_TARGETS,
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
    )
    model = peft.get_peft_model(model, config)
    for name, param in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.02)
    if fused:
        from fusetune.integrations import moe as integration
        from fusetune.integrations import transformers as hf_integration

        try:
            hf_integration.apply(model)
        except (TypeError, ValueError):  # a fusetune whose apply does not know the family
            pass
        integration.route(model)  # idempotent: apply may have routed the experts already
    return model


def _e2e_step(model: torch.nn.Module, device: torch.device, graph: bool) -> Callable[[], object]:
    """bench e2e's step (``graph``: through fusetune.graph_train_step) on a random batch."""
    batch, seq = (E2E_BATCH, E2E_SEQ) if device.type == "cuda" else (2, 16)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), device=device)
    return make_step(model, ids, graph=graph)


def _make_e2e(device: torch.device, quick: bool) -> dict[str, Callable[[], object]]:
    """HF + PEFT (transformers' default experts, grouped_mm), fusetune, and on CUDA fusetune
    with the step as one CUDA graph; one model alive at a time, each built with its warm-up
    steps taken (its AdamW state exists, the graph is captured, before timing)."""
    import gc

    live: dict[str, Callable[[], object]] = {}

    def provider(key: str) -> Callable[[], object]:
        def step() -> object:
            if key not in live:
                live.clear()
                gc.collect()
                model = _e2e_model(device, fused=key != "hf+peft")
                live[key] = _e2e_step(model, device, graph=key.endswith("+graph"))
                graphed = key.endswith("+graph")
                for _ in range(DEFAULT_WARMUP + 1 if graphed else 1):  # (+graph: eager, capture)
                    live[key]()
            return live[key]()

        return step

    keys = ["hf+peft", "fusetune"] + (["fusetune+graph"] if device.type == "cuda" else [])
    return {key: provider(key) for key in keys}


def _e2e_floor(quick: bool) -> float:
    """Forward + dx of the matmuls a token touches (attention projections, its 8 experts, the
    router, lm_head), 4 FLOPs per parameter per token; attention scores on top, not counted."""
    c = E2E_CONFIG
    h, d = c["hidden_size"], c["head_dim"]
    attention = h * d * (2 * c["num_attention_heads"] + 2 * c["num_key_value_heads"])
    experts = c["num_experts_per_tok"] * 3 * h * c["moe_intermediate_size"]
    per_layer = attention + experts + h * c["num_experts"]
    params = c["num_hidden_layers"] * per_layer + h * c["vocab_size"]
    return 4.0 * E2E_BATCH * E2E_SEQ * params


register(
    Case(
        op="moe",
        name=f"e2e LoRA step Qwen3-MoE 4 layers (30B-A3B widths) b{E2E_BATCH} s{E2E_SEQ}",
        make=_make_e2e,
        floor_flops=_e2e_floor,
        gpu_only=True,  # the CPU smoke run keeps to the expert-MLP cases (CI time)
    )
)

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
