"""One Gated DeltaNet chunk-mode fwd+bwd on the GPU at a test shape, synchronised: prints
"ok" with the max gradient gap to IEEE, or the CUDA error. Run one case a process (a CUDA
fault poisons the context); FUSETUNE_GDR_DOT picks the product mode.

    PYTHONPATH=src:tests python tools/gdr_fault_case.py small-fp32|small-bf16|long-bf16
"""

from __future__ import annotations

import os
import sys

import torch

import fusetune

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU: the interpreter

SHAPES = {  # name: (batch, seq_len, key heads, value heads, K, V, dtype)
    "small-fp32": (1, 19, 1, 2, 12, 20, torch.float32),
    "small-bf16": (1, 19, 1, 2, 12, 20, torch.bfloat16),
    "k32-fp32": (1, 20, 1, 2, 32, 40, torch.float32),
    "long-bf16": (2, 1024, 2, 4, 128, 128, torch.bfloat16),
}


def inputs(name: str) -> list[torch.Tensor]:
    b, t, hk, hv, k, v, dtype = SHAPES[name]
    gen = torch.Generator(DEVICE).manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, device=DEVICE)

    q, key = rand(b, t, hk, k), rand(b, t, hk, k) / k**0.5
    return [
        x.to(dtype).requires_grad_()
        for x in (
            q,
            key,
            rand(b, t, hv, v),
            -torch.rand(b, t, hv, generator=gen, device=DEVICE),
            torch.rand(b, t, hv, generator=gen, device=DEVICE),
        )
    ]


def grads(name: str, mode: str) -> list[torch.Tensor]:
    os.environ["FUSETUNE_GDR_DOT"] = mode
    xs = inputs(name)
    o, _ = fusetune.gated_delta_rule(*xs, mode="chunk")
    o.float().square().sum().backward()
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    return [o.detach().float()] + [x.grad.float() for x in xs]


def main() -> None:
    name, mode = sys.argv[1], os.environ.get("FUSETUNE_GDR_DOT", "ieee")
    try:
        got = grads(name, mode)
    except Exception as error:  # noqa: BLE001 - the CUDA error is the result
        print(f"{name} {mode}: FAULT {type(error).__name__}: {str(error).splitlines()[0]}")
        raise SystemExit(1) from None
    want = grads(name, "ieee")
    gaps = [
        ((g - w).abs().max() / w.abs().max().clamp_min(1e-30)).item()
        for g, w in zip(got, want, strict=True)
    ]
    print(
        f"{name} {mode}: ok, max relative gap to ieee (o, dq, dk, dv, dg, dbeta) "
        + " ".join(f"{x:.1e}" for x in gaps)
    )


if __name__ == "__main__":
    main()
