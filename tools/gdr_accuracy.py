"""Gated DeltaNet's bf16 accuracy against float64: fusetune's chunk kernels at each
FUSETUNE_GDR_W level and product mode (FUSETUNE_GDR_DOT) beside FLA's chunk_gated_delta_rule,
on the same inputs (the bench's: raw q, k with use_qk_l2norm_in_kernel, fp32 g, bf16 beta).
Issue 20 weighs FLA's speed against its bf16 buffers and products; this table is the other side
of that trade.

    PYTHONPATH=src:tools:/tmp/site python tools/gdr_accuracy.py [--batch 2 --seq-len 2048]

Each entry is max |x - x64| / max |x64| for o and each gradient. The oracle is
fusetune.reference.gated_delta_rule (the token loop) in float64 on the same device. FLA 0.6
refuses its gated backward on Hopper under Triton < 3.7.1 (its issue #640); the bench lifts
that guard for timing, and so does this tool: its gradients are reported, not trusted. On a
CPU (FUSETUNE_INTERPRET=1, a tiny shape) it is a smoke run of the tool itself.
"""

from __future__ import annotations

import argparse
import os

import torch

import fusetune
from fusetune.bench.cases_gated_delta_rule import _fla_chunk, _inputs
from fusetune.ops.linear_attention import gdr_chunk
from fusetune.reference.gated_delta_rule import gated_delta_rule as reference

NAMES = ("o", "dq", "dk", "dv", "dg", "dbeta")
# (FUSETUNE_GDR_W, FUSETUNE_GDR_DOT) settings, those this checkout has (W=d and DOT=bf16: branch
# gdr-experiments), those a sweep of the same checkout compiled first (gpu_pending.sh gdr-exp)
SETTINGS = [
    (w, dot)
    for w, dot in (
        ("auto", "auto"),
        ("auto", "bf16"),
        ("d", "bf16"),
        ("d", "auto"),
        ("fp32", "auto"),
    )
    if w in gdr_chunk.W_MODES and (dot == "auto" or dot in gdr_chunk.DOT_MODES)
]


def outputs_and_grads(fn, leaves, grad_out) -> list[torch.Tensor]:
    """[o, dq, dk, dv, dg, dbeta] of ``fn(*leaves)`` with cotangent ``grad_out``, in float64."""
    for leaf in leaves:
        leaf.grad = None
    o = fn(*leaves, use_qk_l2norm_in_kernel=True)[0]
    o.backward(grad_out.to(o.dtype))
    return [o.detach().double()] + [leaf.grad.double() for leaf in leaves]


def relative_errors(got: list[torch.Tensor], want: list[torch.Tensor]) -> list[float]:
    return [((a - b).abs().max() / b.abs().max()).item() for a, b in zip(got, want, strict=True)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--dim", type=int, default=128)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    leaves = _inputs(args.batch, args.seq_len, args.heads, args.dim, torch.bfloat16, device)
    grad_out = torch.randn(args.batch, args.seq_len, args.heads, args.dim, device=device,
                           dtype=torch.float64)  # fmt: skip
    wide = [leaf.detach().double().requires_grad_() for leaf in leaves]
    want = outputs_and_grads(reference, wide, grad_out)
    shape = f"B{args.batch} T{args.seq_len} H{args.heads} D{args.dim}"
    print(f"{shape} bf16 l2norm, max |x - x64| / max |x64| ({device.type})")
    print(f"{'provider':52s} " + " ".join(f"{name:>8s}" for name in NAMES), flush=True)

    def row(provider: str, errors: list[float]) -> None:  # each as it ends (a bounded call)
        print(f"{provider:52s} " + " ".join(f"{error:8.1e}" for error in errors), flush=True)

    for w, dot in SETTINGS:
        os.environ["FUSETUNE_GDR_W"], os.environ["FUSETUNE_GDR_DOT"] = w, dot
        got = outputs_and_grads(fusetune.gated_delta_rule, leaves, grad_out)
        row(f"fusetune, W={w} DOT={dot}", relative_errors(got, want))
    os.environ.pop("FUSETUNE_GDR_W")
    os.environ.pop("FUSETUNE_GDR_DOT")
    fla = _fla_chunk() if device.type == "cuda" else None  # (None, with a note, without FLA)
    if fla is not None:
        name, chunk = fla
        row(name, relative_errors(outputs_and_grads(chunk, leaves, grad_out), want))


if __name__ == "__main__":
    main()
