"""Benchmark cases for fusetune's LoRA ops: Llama-3-8B shapes, 8192 tokens, r = 16, bf16 base
weights, forward + backward (x and every adapter get gradients; the base is frozen).

Cases: the MLP block (4096 -> 14336 -> 4096, SwiGLU) through fusetune.lora_mlp, and the
attention projections (4096 -> 4096 / 1024 / 1024) through fusetune.lora_qkv; each with fp32
adapters under bf16 autocast (PEFT's default, as HF Trainer runs it) and with bf16 adapters
(no autocast).

Providers: fusetune; PEFT eager (peft's LoRA layers injected into the same nn.Linear modules,
same weights and dtypes); torch.compile of that PEFT module. PEFT runs on CUDA only (its import
alone costs seconds, too much for the CPU smoke run). The floor is the frozen base's matmuls,
forward plus dx (four times N x in x out FLOPs per projection); the LoRA terms, the activation
and the memory traffic come on top.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

import fusetune
from fusetune.bench.harness import Case, backward_step, register

TOKENS, HIDDEN, INTERMEDIATE, RANK = 8192, 4096, 14336, 16
KV_OUT = 1024
ALPHA = 32
CPU_SIZES = dict(tokens=64, hidden=32, intermediate=96, kv=16, rank=4)
VARIANTS = {  # name -> (adapter dtype, autocast)
    "fp32 adapters, bf16 autocast": (torch.float32, True),
    "bf16 adapters": (torch.bfloat16, False),
}


def _sizes(device: torch.device) -> dict[str, int]:
    if device.type != "cuda":
        return CPU_SIZES
    return dict(tokens=TOKENS, hidden=HIDDEN, intermediate=INTERMEDIATE, kv=KV_OUT, rank=RANK)


class _MLP(torch.nn.Module):
    """transformers' LlamaMLP."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = torch.nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = torch.nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = torch.nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _QKV(torch.nn.Module):
    def __init__(self, hidden: int, kv: int):
        super().__init__()
        self.q_proj = torch.nn.Linear(hidden, hidden, bias=False)
        self.k_proj = torch.nn.Linear(hidden, kv, bias=False)
        self.v_proj = torch.nn.Linear(hidden, kv, bias=False)

    def forward(self, x: torch.Tensor):
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)


def _init(module: torch.nn.Module, rank: int, adapter_dtype: torch.dtype, device):
    """Base weights bf16 (CPU: fp32) and frozen, with trained-looking (non-zero) adapters."""
    base_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if device.type != "cuda":
        adapter_dtype = base_dtype  # the CPU smoke run keeps everything fp32
    module.to(device, base_dtype).requires_grad_(False)
    adapters = {}
    for name, linear in module.named_children():
        in_features, out_features = linear.in_features, linear.out_features
        lora_a = torch.randn(rank, in_features, device=device) / in_features**0.5
        lora_b = torch.randn(out_features, rank, device=device) / rank**0.5 * 0.1
        adapters[name] = (
            torch.nn.Parameter(lora_a.to(adapter_dtype)),
            torch.nn.Parameter(lora_b.to(adapter_dtype)),
        )
    return adapters


def _peft(module: torch.nn.Module, adapters, rank: int):
    """The same module with PEFT's LoRA layers injected, carrying the same adapter tensors."""
    try:
        from peft import LoraConfig, inject_adapter_in_model
    except ImportError:
        return None
    config = LoraConfig(r=rank, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=list(adapters))
    model = inject_adapter_in_model(config, module)
    for name, (lora_a, lora_b) in adapters.items():
        layer = getattr(model, name)
        layer.lora_A["default"].weight = lora_a  # the very Parameters fusetune is given
        layer.lora_B["default"].weight = lora_b
    return model


def _projection(module, adapters, name, rank):
    lora_a, lora_b = adapters[name]
    return (getattr(module, name).weight, lora_a, lora_b, ALPHA / rank)


def _make(block: str, adapter_dtype: torch.dtype, autocast: bool):
    def make(device: torch.device, quick: bool) -> dict[str, Callable[[], object]]:
        sizes = _sizes(device)
        n, h, rank = sizes["tokens"], sizes["hidden"], sizes["rank"]
        if block == "mlp":
            base = _MLP(h, sizes["intermediate"])
        else:
            base = _QKV(h, sizes["kv"])
        adapters = _init(base, rank, adapter_dtype, device)
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        x = torch.randn(n, h, device=device, dtype=dtype, requires_grad=True)
        leaves = [x, *(t for pair in adapters.values() for t in pair)]
        projections = {name: _projection(base, adapters, name, rank) for name in adapters}
        if block == "mlp":
            grads = [torch.randn(n, h, device=device, dtype=dtype)]

            def ours():
                return fusetune.lora_mlp(x, *projections.values())
        else:
            grads = [
                torch.randn(n, p[0].shape[0], device=device, dtype=dtype)
                for p in projections.values()
            ]

            def ours():
                return fusetune.lora_qkv(x, *projections.values())

        amp = torch.bfloat16 if autocast else None
        providers = {"fusetune": backward_step(ours, grads, leaves, amp)}
        if device.type == "cuda":
            peft_module = _peft(base, adapters, rank)
            if peft_module is not None:
                providers["peft"] = backward_step(lambda: peft_module(x), grads, leaves, amp)
                compiled = torch.compile(peft_module)
                providers["peft+torch.compile"] = backward_step(
                    lambda: compiled(x), grads, leaves, amp
                )
        return providers

    return make


def _floor(block: str) -> Callable[[bool], float]:
    """Base forward + dx: 2 matmuls of 2 N in out FLOPs per projection."""

    def floor(quick: bool) -> float:
        n, h, i, kv = TOKENS, HIDDEN, INTERMEDIATE, KV_OUT
        if block == "mlp":
            return 2 * 2.0 * n * 3 * h * i
        return 2 * 2.0 * n * h * (h + 2 * kv)

    return floor


for _variant, (_adapter_dtype, _autocast) in VARIANTS.items():
    register(
        Case(
            op="lora",
            name=f"MLP {TOKENS}x{HIDDEN}->{INTERMEDIATE} r{RANK} {_variant}",
            make=_make("mlp", _adapter_dtype, _autocast),
            floor_flops=_floor("mlp"),
        )
    )
    register(
        Case(
            op="lora",
            name=f"QKV {TOKENS}x{HIDDEN}->{HIDDEN}/{KV_OUT}/{KV_OUT} r{RANK} {_variant}",
            make=_make("qkv", _adapter_dtype, _autocast),
            floor_flops=_floor("qkv"),
        )
    )
